"""Tests of the base-model loading side: config, RoPE, checkpoint tensors, the default model."""
