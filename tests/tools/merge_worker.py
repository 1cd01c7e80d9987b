"""One rank of the 2-process gloo run in test_model_merger.py: train, save sharded checkpoints."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from merge_helpers import train_and_save  # noqa: E402

from hybridrl.engine import destroy_distributed, init_distributed  # noqa: E402

if __name__ == "__main__":
    init_distributed(timeout_s=120)
    try:
        train_and_save(Path(sys.argv[1]), Path(sys.argv[2]))
    finally:
        destroy_distributed()
