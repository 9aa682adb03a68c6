"""The host tier's replicated pieces (`harness.conform.adapters.sglang_hicache`), engine
free: the host-register no-op is scoped and restored, the copy stand-in copies what
sgl-kernel's `transfer_kv_direct` copies, the host args size an inclusive host."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from harness.conform.adapters import sglang_hicache as H  # noqa: E402


def _common() -> types.SimpleNamespace:
    def _cuda_host_register(buffer, registration_granularity_bytes=None):
        raise AssertionError("Torch not compiled with CUDA enabled")

    return types.SimpleNamespace(_cuda_host_register=_cuda_host_register)


def test_host_register_is_a_no_op_inside_and_restored_after() -> None:
    common = _common()
    own = common._cuda_host_register
    with H.unregistered(torch, common):
        assert common._cuda_host_register(torch.zeros(2)) is None
    assert common._cuda_host_register is own


def test_host_register_is_restored_when_the_body_raises() -> None:
    common = _common()
    own = common._cuda_host_register
    with pytest.raises(RuntimeError, match="boom"), H.unregistered(torch, common):
        raise RuntimeError("boom")
    assert common._cuda_host_register is own


def test_the_copy_is_bound_only_inside_and_only_where_unbound() -> None:
    mha = types.SimpleNamespace()
    with H.kv_copy_bound(mha):
        assert mha.transfer_kv_direct is H.transfer_kv_direct
    assert not hasattr(mha, "transfer_kv_direct")
    with pytest.raises(ValueError), H.kv_copy_bound(mha):
        raise ValueError
    assert not hasattr(mha, "transfer_kv_direct")
    kernel = object()
    bound = types.SimpleNamespace(transfer_kv_direct=kernel)
    with H.kv_copy_bound(bound):
        assert bound.transfer_kv_direct is kernel


def test_the_copy_moves_whole_pages_as_a_per_index_copy_does() -> None:
    P = 2
    src = [torch.arange(24.0).reshape(12, 2) + 100 * layer for layer in range(3)]
    dst = [torch.zeros(12, 2) for _ in range(3)]
    want = [d.clone() for d in dst]
    src_idx = torch.tensor([4, 5, 0, 1, 8, 9])
    dst_idx = torch.tensor([2, 3, 10, 11, 6, 7])
    for s_, d_ in zip(src, want):
        d_[dst_idx] = s_[src_idx]  # the plain per-index copy
    H.transfer_kv_direct(src, dst, src_idx, dst_idx, P)
    for got, exp in zip(dst, want):
        assert torch.equal(got, exp)


@pytest.mark.parametrize(("src_n", "dst_n", "idx", "page"), [
    (2, 1, 4, 2), (1, 1, 3, 2), (1, 1, 4, 0)])
def test_the_copy_refuses_what_the_kernel_refuses(src_n, dst_n, idx, page) -> None:
    src = [torch.zeros(8, 2) for _ in range(src_n)]
    dst = [torch.zeros(8, 2) for _ in range(dst_n)]
    with pytest.raises(RuntimeError, match="transfer_kv_direct"):
        H.transfer_kv_direct(src, dst, torch.arange(idx), torch.arange(4), page)


def test_the_host_holds_the_device_copy_and_host_blocks_beyond() -> None:
    args = H.host_args(8, 8)
    assert args["hicache_ratio"] == 2.0 and args["hicache_size"] == 0
    assert args["hicache_write_policy"] == "write_through"
    assert args["hicache_io_backend"] == "direct"


def test_blocked_releases_say_what_blocks_them() -> None:
    assert "sgl_kernel.kvcacheio" in H.blocked_reason("0.5.5", "radix")
    assert "sgl_kernel.kvcacheio" in H.blocked_reason("0.5.12", "radix")
    assert "stubs" in H.blocked_reason("0.5.18", "radix")
    assert "RadixCache" in H.blocked_reason("0.5.23", "radix")
