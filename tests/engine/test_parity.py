"""The engine against transformers + PEFT run per request: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, SamplingParams
from loraplex.kernels import cpu_linear, cpu_lora_gemm, cpu_norm, cpu_sgmv
from loraplex.models import cpu_gemm, llama
from greedy_parity import check_greedy_parity
from native_kernels import require_built, skip_or_fail
from parity_setup import build_case

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    return build_case(tmp_path_factory.mktemp(request.param), request.param)


def make_llm(case, **kw) -> LLM:
    kw.setdefault("kernels", "torch")
    llm = LLM(str(case.model_dir), dtype="float32", device="cpu", max_lora_rank=64, **kw)
    for name, d in case.adapter_dirs.items():
        llm.load_adapter(name, d)
    return llm


def check_outputs(case, outs, skip=()):
    params_logits = True
    for i, out in enumerate(outs):
        if i in skip:
            continue
        assert out.finish_reason == "length"
        p = len(case.prompts[i])
        # Tokens and logits as the reference's, but for a parting at a near tie (tests/greedy_parity.py).
        check_greedy_parity(f"request {i} (adapter {case.adapters[i]})", p, out.token_ids, out.prompt_logits,
                            out.logits, case.ref_tokens[i], case.ref_logits[i])
        assert torch.equal(out.prompt_logits[p - 1], out.logits[0])
    return params_logits


def params(case):
    return SamplingParams(max_tokens=case.max_new, temperature=0.0, ignore_eos=True, return_logits=True)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_mixed_batch_matches_peft(case, kernels):
    # "cpu": the C++ kernels that "auto" takes on the CPU where they build (CI builds them).
    if kernels == "cpu":
        require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    llm = make_llm(case, kernels=kernels)
    assert llm.engine.ops.name == kernels
    outs = llm.generate(case.prompts, params(case), adapters=case.adapters)
    check_outputs(case, outs)
    llm.engine.pager.check_integrity()
    assert llm.engine.stats().kv_pages == 0


@pytest.mark.parametrize("layout", ["out_in", "in_out", "packed", "onednn"])
def test_every_weight_layout_matches_peft(case, layout, monkeypatch):
    # On the CPU the model holds its projections packed for the C++ kernel where it builds (gemm
    # "auto"), else packed for oneDNN where torch has it, else as [in, out] (gemm "mm"); the
    # checkpoint layout [out, in] is what GPUs run. All four must give the same outputs.
    prepacked = {"packed": cpu_linear.available, "onednn": cpu_gemm.onednn_available}  # layout: usable here
    if layout == "packed":
        require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    elif layout == "onednn" and not cpu_gemm.onednn_available():
        skip_or_fail("oneDNN's linear is not usable in this torch")
    monkeypatch.setattr(llama, "WEIGHTS_IN_OUT_ON_CPU", layout == "in_out")
    if layout == "out_in":  # as on a GPU: torch's RMSNorm too, not the C++ one fused with the residual add
        monkeypatch.setattr(cpu_norm, "available", lambda: False)
    llm = make_llm(case, max_num_batched_tokens=16, gemm=layout if layout in prepacked else "mm")
    assert llm.engine.model.layout == layout
    fused_norm = llm.engine.model.pointwise.add_rms_norm is not llama.add_rms_norm
    assert fused_norm == (layout != "out_in" and cpu_norm.available())
    assert llm.engine.model.head_layout == (layout if layout in prepacked else "out_in")  # the LM head too
    outs = llm.generate(case.prompts, params(case), adapters=case.adapters)
    check_outputs(case, outs)


def test_prefill_lora_in_the_gemm_epilogue_matches_peft(tmp_path, monkeypatch):
    # A model whose pool rows (D = 32) and projection boundaries sit on the packed GEMM's panel grid:
    # prompts longer than LONG_SEGMENT whose adapter's ranks are multiples of 8 get their deltas in
    # the GEMM's epilogue, the others (and every decode token) through the SGMV kernel, in one batch.
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    if 32 % cpu_linear.panel_width():
        pytest.skip(f"panels of {cpu_linear.panel_width()} columns do not divide this model's D = 32")
    # Prompts of more than LONG_SEGMENT tokens: every adapter with ranks of multiples of 8 gets a segment
    # in the epilogue, the others a long segment through the SGMV kernel.
    case = build_case(tmp_path, "llama", prompt_lens=(cpu_sgmv.LONG_SEGMENT + 1, 60), hidden_size=128,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    calls = []
    real = cpu_lora_gemm.linear_lora
    monkeypatch.setattr(cpu_lora_gemm, "linear_lora", lambda *a: calls.append(a[4]) or real(*a))
    llm = make_llm(case, kernels="cpu", gemm="packed")
    assert llm.engine.model.gemm_lora(llm.engine.pager.geometry.row_width)
    outs = llm.generate(case.prompts, params(case), adapters=case.adapters)
    check_outputs(case, outs)
    assert calls, "no prefill segment went through the GEMM epilogue"
    assert all(s.length > cpu_sgmv.LONG_SEGMENT for batch in calls for s in batch.segments)


def test_chunked_prefill_matches_peft(case):
    # A token budget smaller than most prompts: prompts run in several chunks beside decodes.
    llm = make_llm(case, max_num_batched_tokens=7)
    outs = llm.generate(case.prompts, params(case), adapters=case.adapters)
    check_outputs(case, outs)
    llm.engine.pager.check_integrity()


def test_tiny_pool_preempts_and_evicts(case):
    """Pools from roomy to barely enough for the largest request and its adapter: every run must
    match the reference; the small ones must have preempted requests and evicted adapters."""
    probe = make_llm(case)
    geo = probe.engine.pager.geometry
    eng = probe.engine
    adapter_pages = max(geo.adapter_num_pages(eng.adapters.host(eng.adapters.resolve(n))) for n in case.adapter_dirs)
    longest = max(len(p) for p in case.prompts) + case.max_new
    minimum = geo.kv_pages_for_tokens(longest) + adapter_pages
    preemptions = evictions = 0
    for factor in (2.0, 1.5, 1.2, 1.0):
        llm = make_llm(case, pool_bytes=int(minimum * factor) * geo.page_bytes)
        outs = llm.generate(case.prompts, params(case), adapters=case.adapters)
        check_outputs(case, outs)
        llm.engine.pager.check_integrity()
        assert llm.engine.stats().kv_pages == 0
        preemptions += llm.engine.stats().num_preemptions
        evictions += llm.engine.pager.stats().adapter_evictions
    assert preemptions > 0, "the pools were meant to be too small to avoid preemption"
    assert evictions > 0, "the pools were meant to be too small to keep every adapter resident"


def test_aborts_mid_run(case):
    llm = make_llm(case, max_num_batched_tokens=16)
    eng = llm.engine
    p = params(case)
    reqs = [eng.add_request(pr, p, a) for pr, a in zip(case.prompts, case.adapters)]
    to_abort = {1, 4, 7}
    finals = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps == 5:
            for i in to_abort:
                out = eng.abort_request(reqs[i].request_id)
                assert out is not None and out.finish_reason == "abort"
            eng.pager.check_integrity()
            # Aborted requests hold no pages any more.
            assert all(eng.pager.kv_num_blocks(reqs[i].request_id) == 0 for i in to_abort)
    outs = [finals.get(r.request_id) for r in reqs]
    check_outputs(case, outs, skip=to_abort)
    eng.pager.check_integrity()
    assert eng.stats().kv_pages == 0
