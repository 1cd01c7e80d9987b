"""The driver side: the PPO/GRPO fit loop, metrics, trackers, checkpoints, entry points."""
