"""lora."""
