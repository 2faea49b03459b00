"""Reference models built from the plugin's tensor-parallel layers."""
from .gpt import GPT, gpt_loss
from .gpt_config import GPTConfig, GPTConfigError

__all__ = ["GPT", "GPTConfig", "GPTConfigError", "gpt_loss"]
