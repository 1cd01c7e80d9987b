"""hybridrl: RL post-training for LLMs on the HybridFlow design."""

__version__ = "0.1.0"
