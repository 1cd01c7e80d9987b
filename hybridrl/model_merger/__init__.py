"""Turn a sharded training checkpoint into a Hugging Face folder, and check one against a reference.

    python -m hybridrl.model_merger merge --local_dir <ckpt>/global_step_N/actor --target_dir <out>
    python -m hybridrl.model_merger test  --local_dir <ckpt>/global_step_N/actor --test_hf_dir <ref>

A checkpoint directory (``actor/`` or ``critic/``) is what ``TrainEngine.save_checkpoint`` wrote
(``model_optim/`` in torch.distributed.checkpoint format, any world size) plus ``huggingface/``
(config, generation config, tokenizer) that the workers save beside it, so a merge needs nothing
from the original model path. See docs/model_merger.md.
"""

from hybridrl.model_merger.core import (
    HF_SUBDIR,
    Mismatch,
    checkpoint_summary,
    compare_state_dicts,
    compare_with_reference,
    find_checkpoint_dir,
    is_critic_state,
    is_engine_checkpoint,
    load_merged,
    load_merged_model,
    load_model_state,
    merge_checkpoint,
    save_checkpoint_metadata,
)

__all__ = [
    "HF_SUBDIR",
    "Mismatch",
    "checkpoint_summary",
    "compare_state_dicts",
    "compare_with_reference",
    "find_checkpoint_dir",
    "is_critic_state",
    "is_engine_checkpoint",
    "load_merged",
    "load_merged_model",
    "load_model_state",
    "merge_checkpoint",
    "save_checkpoint_metadata",
]
