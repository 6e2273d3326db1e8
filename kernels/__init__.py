"""Kernels: SGMV shrink/expand and paged attention over the unified pool, behind one dispatcher."""

from .dispatch import KERNEL_CHOICES, KernelOps, select_kernels
from .metadata import AttentionMetadata, LoraBatch, LoraDeviceTensors, LoraSegment

__all__ = [
    "KERNEL_CHOICES",
    "AttentionMetadata",
    "KernelOps",
    "LoraBatch",
    "LoraDeviceTensors",
    "LoraSegment",
    "select_kernels",
]
