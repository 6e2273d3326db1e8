"""The C++ packer (kernels/cpu_pack.cpp) writes exactly the rows of the numpy/torch path of write_rows,
and both name the same first matrix holding a NaN or an Inf when asked.

Random modules of mixed ranks and shapes (PEFT's A [r, in] and B [out, r], some given as transposed
or strided views), in float16/bfloat16/float32/float64, into an output poisoned with NaN; both paths
must agree bit for bit and leave the tail past the packed rows untouched. Where the packer cannot be
built the test skips with the build error, except under CI.
"""

from __future__ import annotations

import os

import pytest
import torch
from loraplex.kernels.cpu_build import load_extension
from loraplex.lora.types import TARGET_MODULES, LoraModuleWeights
from loraplex.unified_pager import adapter_rows
from native_kernels import require_built


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_pack", load_extension("cpu_pack") is not None, "packer")


def _modules(g: torch.Generator, dtype: torch.dtype, d: int) -> list[LoraModuleWeights]:
    mods = []
    for layer in range(3):
        for mi, name in enumerate(TARGET_MODULES):
            rank = int(torch.randint(1, 40, (), generator=g))
            in_f = d * int(torch.randint(1, 5, (), generator=g))
            out_f = d * int(torch.randint(1, 5, (), generator=g))
            a = torch.randn(rank, in_f, generator=g).to(dtype)
            b = torch.randn(out_f, rank, generator=g).to(dtype)
            if mi % 3 == 1:  # A given as a transposed view of A^T, as packed adapters hold it
                a = a.t().contiguous().t()
            if mi % 3 == 2:  # B as a strided column slice of a wider tensor
                b = torch.randn(out_f, rank + 5, generator=g).to(dtype)[:, 2 : 2 + rank]
            mods.append(LoraModuleWeights(layer, name, rank, 2.0, a, b))
    return mods


def _random_case(dtype: torch.dtype, d: int = 8) -> tuple[torch.Generator, list[LoraModuleWeights], int]:
    """(generator, modules, rows they pack into) on a fresh seed."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    mods = _modules(g, dtype, d)
    return g, mods, sum((m.a.numel() + m.b.numel()) // d for m in mods)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_cpp_packer_matches_the_python_path(dtype, monkeypatch):
    d = 8
    _, mods, rows = _random_case(dtype, d)
    cpp = torch.full((rows + 3, d), float("nan"), dtype=dtype)
    adapter_rows.write_rows(mods, d, cpp)  # the C++ path: sources and output share the dtype
    monkeypatch.setattr(adapter_rows, "_write_rows_cpp", lambda *args: None)
    ref = torch.full((rows + 3, d), float("nan"), dtype=dtype)
    adapter_rows.write_rows(mods, d, ref)
    assert torch.equal(cpp[:rows], ref[:rows])
    assert torch.isnan(cpp[rows:].float()).all()  # nothing written past the packed rows
    row = 0
    for m in mods:  # and the layout itself: A^T then B^T, back to back
        n = m.a.numel() // d
        assert torch.equal(cpp[row : row + n].reshape(m.a.shape[1], m.rank), m.a.t())
        row += n
        n = m.b.numel() // d
        assert torch.equal(cpp[row : row + n].reshape(m.rank, m.b.shape[0]), m.b.t())
        row += n


def test_cpp_packer_refuses_what_does_not_fit():
    ext = load_extension("cpu_pack")
    out = torch.zeros(10)
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.transpose_into([torch.ones(3, 3)], out, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="dtype"):
        ext.transpose_into([torch.ones(2, 2, dtype=torch.float64)], out, torch.tensor([0]))
    assert torch.equal(out, torch.zeros(10))  # checked before anything is written


def test_a_cast_falls_back_to_the_python_path():
    m = LoraModuleWeights(0, "q_proj", 2, 1.0, torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 2,
                                                                                                 dtype=torch.float64))
    out = torch.empty(4, 4, dtype=torch.float32)
    assert adapter_rows._write_rows_cpp([m], out, True) is None
    adapter_rows.write_rows([m], 4, out)
    assert torch.equal(out[:2].reshape(4, 2), m.a.t().float()) and torch.equal(out[2:].reshape(2, 4), m.b.t().float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_both_paths_name_the_first_non_finite_matrix(dtype, monkeypatch):
    d = 8
    g, mods, rows = _random_case(dtype, d)
    mats = [t for m in mods for t in (m.a, m.b)]
    assert adapter_rows.write_rows(mods, d, torch.empty(rows, d, dtype=dtype), check_finite=True) is None
    # Poison two random matrices at random elements (through the views, strided ones included).
    picks = sorted(torch.randperm(len(mats), generator=g)[:2].tolist())
    for k, bad in zip(picks, (float("-inf"), float("nan"))):
        w = mats[k]
        i, j = (int(torch.randint(s, (), generator=g)) for s in w.shape)
        w[i, j] = bad
    got = {}
    for path in ("cpp", "python"):
        if path == "python":
            monkeypatch.setattr(adapter_rows, "_write_rows_cpp", lambda *args: None)
        out = torch.zeros(rows, d, dtype=dtype)
        got[path] = adapter_rows.write_rows(mods, d, out, check_finite=True)
        assert not torch.isfinite(out.float()).all()  # still written, poison and all
        assert adapter_rows.write_rows(mods, d, out) is None  # not asked: not checked
    assert got == {"cpp": picks[0], "python": picks[0]}


def test_avx_blocks_and_their_edges_transpose_exactly():
    """Sizes around the 8 x 8 vector blocks (rows and columns 1..20) and the scalar tiles (16)."""
    ext = load_extension("cpu_pack")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    srcs = [torch.randn(m, n, generator=g) for m in (1, 7, 8, 9, 16, 17, 20) for n in (1, 8, 13, 16, 20)]
    srcs.append(torch.randn(24, 40, generator=g)[::2, 3:35])  # strided rows: the scalar path
    sizes = torch.tensor([t.numel() for t in srcs])
    offsets = sizes.cumsum(0) - sizes
    out = torch.full((int(sizes.sum()) + 5,), float("nan"))
    assert ext.transpose_into(srcs, out, offsets, 0x7F800000) == -1
    for t, o in zip(srcs, offsets.tolist()):
        assert torch.equal(out[o : o + t.numel()].view(t.shape[1], t.shape[0]), t.t())
    assert torch.isnan(out[-5:]).all()
    for k in torch.randperm(len(srcs), generator=g)[:6].tolist():  # a NaN or Inf at either end is seen
        t = srcs[k]
        for i, j in ((0, 0), (t.shape[0] - 1, t.shape[1] - 1)):
            keep = t[i, j].item()
            t[i, j] = float("inf")
            assert ext.transpose_into(srcs, out, offsets, 0x7F800000) == k
            t[i, j] = keep


_MASKS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000, torch.float64: 0x7FF0000000000000}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "numpy"])
def test_packing_from_a_byte_buffer_transposes_each_matrix_at_its_offset(dtype, kind):
    """transpose_from_buffer (the pack plans' copy): row-major matrices laid in one buffer, with gaps and
    out of order, each written transposed at its output offset; the rest of the output untouched."""
    ext = load_extension("cpu_pack")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    size = dtype.itemsize
    mats = [torch.randn(int(torch.randint(1, 30, (), generator=g)), int(torch.randint(1, 30, (), generator=g)),
                        generator=g).to(dtype) for _ in range(9)]
    order = torch.randperm(len(mats), generator=g).tolist()  # the buffer holds them in another order
    blob, where = bytearray(b"\xff" * 3 * size), {}  # a header-like prefix, as a file's data follows its header
    base = len(blob)
    for k in order:
        blob += b"\xee" * size * int(torch.randint(0, 3, (), generator=g))  # gaps between matrices
        where[k] = len(blob) - base
        blob += mats[k].contiguous().view(torch.uint8).numpy().tobytes()
    data = {"bytes": bytes(blob), "bytearray": blob, "numpy": torch.frombuffer(blob, dtype=torch.uint8).numpy()}[kind]
    sizes = torch.tensor([t.numel() for t in mats])
    offsets = sizes.cumsum(0) - sizes
    out = torch.full((int(sizes.sum()) + 4,), float("nan"), dtype=dtype)
    shapes = torch.tensor([list(t.shape) for t in mats])
    byte_offsets = torch.tensor([where[k] for k in range(len(mats))])
    assert ext.transpose_from_buffer(data, base, byte_offsets, shapes, out, offsets, _MASKS[dtype]) == -1
    for t, o in zip(mats, offsets.tolist()):
        assert torch.equal(out[o : o + t.numel()].view(t.shape[1], t.shape[0]), t.t())
    assert torch.isnan(out[-4:].float()).all()
    k = int(torch.randint(len(mats), (), generator=g))  # a NaN in one matrix: named, all still written
    bad = mats[k].clone()
    bad.view(-1)[int(torch.randint(bad.numel(), (), generator=g))] = float("nan")
    start = base + where[k]
    blob[start : start + bad.numel() * size] = bad.view(torch.uint8).numpy().tobytes()
    assert ext.transpose_from_buffer(bytes(blob), base, byte_offsets, shapes, out, offsets, _MASKS[dtype]) == k
    assert ext.transpose_from_buffer(bytes(blob), base, byte_offsets, shapes, out, offsets, 0) == -1


def test_packing_from_a_byte_buffer_refuses_what_does_not_fit():
    ext = load_extension("cpu_pack")
    blob = torch.randn(6).view(torch.uint8).numpy().tobytes()  # 24 bytes: a [2, 3] float32 matrix
    out = torch.zeros(8)
    args = (torch.tensor([[2, 3]]), out, torch.tensor([0]), 0)
    assert ext.transpose_from_buffer(blob, 0, torch.tensor([0]), *args) == -1
    out.zero_()
    for base, offset, match in ((4, 0, "inside the buffer"), (0, 4, "inside the buffer"),
                                (0, -4, "negative"), (-4, 0, "negative")):
        with pytest.raises(RuntimeError, match=match):
            ext.transpose_from_buffer(blob, base, torch.tensor([offset]), *args)
    with pytest.raises(RuntimeError, match="does not fit in out"):
        ext.transpose_from_buffer(blob, 0, torch.tensor([0]), torch.tensor([[2, 3]]), out, torch.tensor([3]), 0)
    with pytest.raises(RuntimeError, match="shapes"):
        ext.transpose_from_buffer(blob, 0, torch.tensor([0]), torch.tensor([2, 3]), out, torch.tensor([0]), 0)
    with pytest.raises(RuntimeError, match="flat byte buffer"):
        ext.transpose_from_buffer(torch.zeros(6).numpy(), 0, torch.tensor([0]), *args)  # float items
    assert torch.equal(out, torch.zeros(8))  # checked before anything is written
    # A matrix that starts between elements: nothing written, -2 (the caller takes its other path).
    assert ext.transpose_from_buffer(b"\0" + blob, 1, torch.tensor([0]), torch.tensor([[1, 5]]), out,
                                     torch.tensor([0]), 0) == -2
    assert torch.equal(out, torch.zeros(8))


def _matrices_in_a_file(g: torch.Generator, dtype: torch.dtype, path) -> tuple[list[torch.Tensor], int, torch.Tensor]:
    """Row-major matrices written after a header-like prefix, with gaps and out of order: (matrices, the data's
    first byte, each matrix's byte offset from it)."""
    size = dtype.itemsize
    mats = [torch.randn(int(torch.randint(1, 70, (), generator=g)), int(torch.randint(1, 70, (), generator=g)),
                        generator=g).to(dtype) for _ in range(13)]
    blob, where = bytearray(b"\xff" * 5 * size), {}
    base = len(blob)
    for k in torch.randperm(len(mats), generator=g).tolist():
        blob += b"\xee" * size * int(torch.randint(0, 3, (), generator=g))
        where[k] = len(blob) - base
        blob += mats[k].contiguous().view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(blob))
    return mats, base, torch.tensor([where[k] for k in range(len(mats))])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_packing_from_a_file_writes_what_packing_from_its_bytes_does(tmp_path, dtype):
    """transpose_from_file (folder loads by a pack plan): each thread reads its matrices from the file and
    transposes them; the output is bit for bit transpose_from_buffer's over the same bytes, the first matrix
    holding a NaN or an Inf is named the same, and the output's tail is untouched."""
    ext = load_extension("cpu_pack")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    path = tmp_path / "weights.bin"
    mats, base, byte_offsets = _matrices_in_a_file(g, dtype, path)
    sizes = torch.tensor([t.numel() for t in mats])
    offsets = sizes.cumsum(0) - sizes
    shapes = torch.tensor([list(t.shape) for t in mats])

    def both(mask: int) -> tuple[int, torch.Tensor, int, torch.Tensor]:
        outs, codes = [], []
        for how in ("buffer", "file"):
            out = torch.full((int(sizes.sum()) + 4,), float("nan"), dtype=dtype)
            if how == "buffer":
                codes.append(ext.transpose_from_buffer(path.read_bytes(), base, byte_offsets, shapes, out, offsets,
                                                       mask))
            else:
                with path.open("rb") as f:
                    codes.append(ext.transpose_from_file(f.fileno(), base, byte_offsets, shapes, out, offsets, mask))
            outs.append(out)
        return codes[0], outs[0], codes[1], outs[1]

    code_b, out_b, code_f, out_f = both(_MASKS[dtype])
    assert code_b == code_f == -1
    assert torch.equal(out_f.view(torch.uint8), out_b.view(torch.uint8))
    for t, o in zip(mats, offsets.tolist()):
        assert torch.equal(out_f[o : o + t.numel()].view(t.shape[1], t.shape[0]), t.t())
    assert torch.isnan(out_f[-4:].float()).all()
    k = int(torch.randint(len(mats), (), generator=g))  # a NaN in one matrix: both name it
    bad = mats[k].clone()
    bad.view(-1)[int(torch.randint(bad.numel(), (), generator=g))] = float("nan")
    blob = bytearray(path.read_bytes())
    start = base + int(byte_offsets[k])
    blob[start : start + bad.numel() * dtype.itemsize] = bad.view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(blob))
    code_b, out_b, code_f, out_f = both(_MASKS[dtype])
    assert code_b == code_f == k
    assert torch.equal(out_f.view(torch.uint8), out_b.view(torch.uint8))
    assert both(0)[2] == -1


def test_packing_from_a_file_that_came_short_says_so(tmp_path):
    """A matrix past the file's end (it shrank after its header was read): -3, so that the caller takes its
    full path; arguments that cannot be right are refused before anything is read or written."""
    ext = load_extension("cpu_pack")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    path = tmp_path / "weights.bin"
    mats, base, byte_offsets = _matrices_in_a_file(g, torch.float32, path)
    sizes = torch.tensor([t.numel() for t in mats])
    offsets, shapes = sizes.cumsum(0) - sizes, torch.tensor([list(t.shape) for t in mats])
    out = torch.zeros(int(sizes.sum()))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 4)  # the last matrix in the file loses its last element
        mask = _MASKS[torch.float32]
        assert ext.transpose_from_file(f.fileno(), base, byte_offsets, shapes, out, offsets, mask) == -3
        out.zero_()
        args = (torch.tensor([[2, 3]]), out, torch.tensor([0]), 0)
        for fd, b, offset, match in ((f.fileno(), -4, 0, "negative"), (-1, 0, 0, "negative"),
                                     (f.fileno(), 0, -4, "negative")):
            with pytest.raises(RuntimeError, match=match):
                ext.transpose_from_file(fd, b, torch.tensor([offset]), *args)
        with pytest.raises(RuntimeError, match="does not fit in out"):
            ext.transpose_from_file(f.fileno(), 0, torch.tensor([0]), torch.tensor([[2, 3]]), out,
                                    torch.tensor([out.numel() - 5]), 0)
        assert torch.equal(out, torch.zeros_like(out))
    fd = os.open(tmp_path, os.O_RDONLY)  # a read that fails (EISDIR) rather than comes short
    try:
        assert ext.transpose_from_file(fd, 0, torch.tensor([0]), torch.tensor([[2, 3]]), out, torch.tensor([0]),
                                       0) == -3
    finally:
        os.close(fd)
