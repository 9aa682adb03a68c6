"""What a FlashInfer plan bakes into a captured CUDA graph, and how two plans differ.

A CUDA-graph wrapper's plan() rewrites the metadata and the integer workspace the
captured kernels read, but the launch itself was fixed at capture: its grid, and the
plan-info vector run() hands the kernel (split-KV or not, the padded work count, the
workspace offsets of every work array). A replay is valid only while a new plan
produces the same vector as the plan seen at capture. FlashInfer 0.6.x and 0.7.x keep
that vector as the wrapper's `_plan_info` (a sequence of ints from the C++ planner:
DecodePlanInfo, 10 fields; PrefillPlanInfo, 15; the FA3 PrefillPlanSM90Info, 9), and
the resolved kernels as `_backend` (decode wrappers also report `resolved_backend`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

# Field names of the planner's plan-info vectors by their length (include/flashinfer/
# attention/scheduler.cuh), only for messages: the comparison is over the whole vector.
PLAN_INFO_FIELDS: dict[int, tuple[str, ...]] = {
    10: ("padded_batch_size", "v_offset", "s_offset", "request_indices_offset",
         "kv_tile_indices_offset", "o_indptr_offset", "block_valid_mask_offset",
         "kv_chunk_size_ptr_offset", "enable_cuda_graph", "split_kv"),
    15: ("padded_batch_size", "total_num_rows", "total_num_rows_offset", "cta_tile_q",
         "request_indices_offset", "qo_tile_indices_offset", "kv_tile_indices_offset",
         "merge_indptr_offset", "o_indptr_offset", "kv_chunk_size_ptr_offset", "v_offset",
         "s_offset", "block_valid_mask_offset", "enable_cuda_graph", "split_kv"),
    9: ("qo_tile_indices_offset", "qo_indptr_offset", "kv_indptr_offset", "qo_len_offset",
        "kv_len_offset", "head_indices_offset", "work_indptr_offset", "batch_indices_offset",
        "same_schedule_for_all_heads"),
}
CUDA_CORES = "cuda-cores"


def resolved_family(wrapper: Any) -> str | None:
    """The kernels `wrapper`'s last plan chose: "cuda-cores" for a decode wrapper on the
    CUDA-core kernel, else FlashInfer's resolved backend ("fa2", "fa3", ...); None before
    a wrapper asked for "auto" has planned."""
    if getattr(wrapper, "use_tensor_cores", True) is False:
        return CUDA_CORES
    family = getattr(wrapper, "resolved_backend", None) or getattr(wrapper, "_backend", None)
    return None if family in (None, "auto") else str(family)


class PlanLayout(NamedTuple):
    """The part of a plan a captured graph depends on: kernels and plan-info vector."""

    family: str
    plan_info: tuple[int, ...]

    @classmethod
    def of(cls, wrapper: Any) -> PlanLayout:
        """The layout of `wrapper`'s last plan. Raises RuntimeError when the wrapper keeps
        no plan-info vector (a FlashInfer release or kernel family this check does not
        know), since replay safety could then not be checked."""
        family = resolved_family(wrapper)
        info = getattr(wrapper, "_plan_info", None)
        if family is None or info is None:
            raise RuntimeError(
                f"cannot check CUDA-graph replay safety: {type(wrapper).__name__} keeps no "
                f"plan info after plan() (kernels {family!r}); this FlashInfer release or "
                f"kernel family is not supported with cuda_graph=True")
        return cls(family, tuple(int(x) for x in info))

    def changes(self, since: PlanLayout) -> list[str]:
        """What differs from the layout `since`, one "field old -> new" string each
        (fields named where the vector's length is known); empty when equal."""
        if self.family != since.family:
            return [f"kernels {since.family} -> {self.family}"]
        if len(self.plan_info) != len(since.plan_info):
            return [f"plan info length {len(since.plan_info)} -> {len(self.plan_info)}"]
        names = PLAN_INFO_FIELDS.get(len(self.plan_info))
        return [f"{names[i] if names else f'plan_info[{i}]'} {old} -> {new}"
                for i, (old, new) in enumerate(zip(since.plan_info, self.plan_info, strict=True))
                if old != new]
