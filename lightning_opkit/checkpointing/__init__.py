"""ActivationCheckpointing and its Trainer-free parts: the checkpointed forward and the saved-bytes counter."""

from lightning_opkit.checkpointing.activation_checkpointing import ActivationCheckpointing, Price

__all__ = ["ActivationCheckpointing", "Price"]
