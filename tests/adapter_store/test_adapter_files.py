"""The fast test writer makes the same files as real PEFT: same keys, shapes and accepted config."""

from __future__ import annotations

from safetensors.torch import load_file

from adapter_files import write_peft_adapter
from factories import make_peft_adapter
from loraplex.lora.peft_loader import load_peft_adapter


def test_fast_writer_matches_peft(tiny_model_dir, tiny_config, tmp_path):
    targets = ("q_proj", "v_proj", "down_proj")
    peft_dir = make_peft_adapter(tiny_model_dir, tmp_path / "peft", r=4, target_modules=targets, lora_alpha=16)
    fast_dir = write_peft_adapter(tmp_path / "fast", tiny_config, r=4, targets=targets, alpha=16)
    peft, fast = load_file(peft_dir / "adapter_model.safetensors"), load_file(fast_dir / "adapter_model.safetensors")
    assert {k: v.shape for k, v in peft.items()} == {k: v.shape for k, v in fast.items()}
    assert sorted(p.name for p in peft_dir.iterdir()) == sorted(p.name for p in fast_dir.iterdir())
    a, b = load_peft_adapter("p", peft_dir, tiny_config, 16), load_peft_adapter("f", fast_dir, tiny_config, 16)
    assert [(m.layer, m.module, m.rank, m.scale) for m in a.modules] == [(m.layer, m.module, m.rank, m.scale)
                                                                          for m in b.modules]
