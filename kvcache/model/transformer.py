"""A small Llama-style decoder, optionally hybrid with a recurrent mixer, and named presets.

The model owns no KV cache and no recurrent state. Every attention layer hands its rotated
q, k, v to the engine's `ForwardContext`, which stores k and v (paged or not) and attends;
every recurrent layer reads and writes its per-request state through the same context. A
step's T tokens are the new tokens of all requests in the batch, concatenated in batch order.

The math follows Hugging Face's Llama exactly (RMSNorm in float32, RoPE with the
rotate-half convention, SwiGLU), so HF checkpoints load without permuting weights
(see `kvcache.model.checkpoint`).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvcache.model.config import ModelConfig


class ForwardContext(Protocol):
    """What the engine supplies to one forward pass; the model calls it once per layer.

    `layer` is always the global layer index (0 .. num_layers - 1).
    """

    @property
    def seq_lens(self) -> list[int]:
        """New tokens per request, in batch order; they sum to T."""
        ...

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store k, v for the new tokens, then attend causally (and within the window).

        q: [T, Hq, D], k and v: [T, Hkv, D], contiguous, RoPE already applied. The context
        applies the softmax scale 1/sqrt(D) and GQA (query head h reads kv head h // (Hq/Hkv)).
        Returns [T, Hq, D] in q's dtype.
        """
        ...

    def recurrent_state(self, layer: int) -> Tensor:
        """State before this step, [num_requests, hidden]; zeros for a fresh request."""
        ...

    def set_recurrent_state(self, layer: int, state: Tensor, token_states: Tensor) -> None:
        """Receive the state after this step, [num_requests, hidden], and after each of
        its tokens, [T, hidden] (for snapshots at block ends), both float32."""
        ...


class Rope(NamedTuple):
    """Rotary tables for a step's tokens: cos and sin, each [T, D], in the activation dtype."""

    cos: Tensor
    sin: Tensor


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> Rope:
    """Cos/sin for absolute `positions` [T], computed in float32 as HF Llama does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [D/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]: halves, not interleaved pairs
    return Rope(angles.cos().to(dtype), angles.sin().to(dtype))


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate x [T, H, D] by its token's angle (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * rope.cos[:, None, :] + rotated * rope.sin[:, None, :]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Fused qkv projection and RoPE; the attention itself is the context's."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.wo = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        tokens = x.shape[0]
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(tokens, self.num_heads, self.head_dim), rope)  # [T, Hq, D]
        k = apply_rope(k.view(tokens, self.num_kv_heads, self.head_dim), rope)  # [T, Hkv, D]
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous()  # [T, Hkv, D]
        out = ctx.attention(self.layer, q, k, v)  # [T, Hq, D]
        return self.wo(out.reshape(tokens, self.q_size))  # [T, hidden]


class Recurrence(nn.Module):
    """An SSM-like mixer: a diagonal linear recurrence per request, in place of attention.

    h_t = a * h_{t-1} + (1 - a) * (W_in x_t), a = sigmoid(decay) per channel, y_t = W_o h_t.

    The state after a step summarises every token so far and cannot be rolled back to an
    earlier token, so KV blocks cannot stand in for it: a model with this layer reuses
    cached prefixes only where the engine kept a snapshot of the state. The layer hands the
    state after every token to the context (`set_recurrent_state`), which is what makes
    snapshots at block ends possible (`supports_snapshots`).
    """

    supports_snapshots: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.hidden_size = config.hidden_size
        self.win = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.decay = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        seq_lens = ctx.seq_lens
        state = ctx.recurrent_state(self.layer).float()  # [R, hidden]
        if state.shape != (len(seq_lens), self.hidden_size):
            raise ValueError(
                f"recurrent_state(layer={self.layer}) has shape {tuple(state.shape)}, "
                f"expected {(len(seq_lens), self.hidden_size)} for seq_lens={seq_lens}"
            )
        decay = self.decay.float()
        drive = torch.sigmoid(-decay) * self.win(x).float()  # [T, hidden]: (1 - a) W_in x
        states, final = diagonal_scan(drive, F.logsigmoid(decay), state, seq_lens)
        ctx.set_recurrent_state(self.layer, final, states)  # [R, hidden], [T, hidden]
        return self.wo(states.to(x.dtype))  # [T, hidden]


_SCAN_BLOCK = 64  # tokens advanced per step: fewer Python steps vs a [L, L, C] weight table


def diagonal_scan(
    drive: Tensor, log_a: Tensor, state: Tensor, seq_lens: list[int]
) -> tuple[Tensor, Tensor]:
    """h_t = a * h_{t-1} + drive_t along each request's tokens, all requests at once.

    drive: [T, C] (requests concatenated), log_a: [C] (a in (0, 1)), state: [R, C] before
    the step. Returns (h for every token [T, C], state after the step [R, C]), float32.
    Inside a block of L tokens h_{s+i} = a^(i+1) h_s + sum_{j<=i} a^(i-j) drive_{s+j}: one
    batched matmul per block instead of L dependent steps. Results match the step-by-step
    recurrence to float32 rounding, not bitwise (they depend on block boundaries).
    """
    if all(n == 1 for n in seq_lens):  # decode: no index tensors, so CUDA-graph capturable
        final = torch.exp(log_a) * state + drive
        return final, final
    requests, longest = len(seq_lens), max(seq_lens)
    lens = torch.tensor(seq_lens, device=drive.device)
    owner = torch.repeat_interleave(torch.arange(requests, device=drive.device), lens)  # [T]
    offset = torch.arange(drive.shape[0], device=drive.device) - (lens.cumsum(0) - lens)[owner]
    padded = drive.new_zeros(requests, longest, drive.shape[1])  # [R, Lmax, C]
    padded[owner, offset] = drive
    steps = torch.arange(min(_SCAN_BLOCK, longest), device=drive.device)
    lag = steps[:, None] - steps[None, :]  # [L, L]: i - j
    weight = torch.exp(lag.clamp(min=0)[..., None] * log_a) * (lag >= 0)[..., None]  # [L, L, C]
    carry = torch.exp((steps + 1)[:, None] * log_a)  # [L, C]: a^(i+1)
    out = torch.empty_like(padded)
    h = state  # [R, C]; rows of requests already finished run on harmlessly over padding
    for start in range(0, longest, _SCAN_BLOCK):
        block = padded[:, start : start + _SCAN_BLOCK]  # [R, L, C]
        n = block.shape[1]
        hs = torch.einsum("ijc,rjc->ric", weight[:n, :n], block) + carry[:n] * h[:, None, :]
        out[:, start : start + n] = hs
        h = hs[:, -1]
    last = out[torch.arange(requests, device=drive.device), (lens - 1).clamp(min=0)]
    final = torch.where((lens > 0)[:, None], last, state)  # a request with no new tokens
    return out[owner, offset], final


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer: Attention | Recurrence
        if config.mixer_types[layer] == "attention":
            self.mixer = Attention(config, layer)
        else:
            self.mixer = Recurrence(config, layer)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        normed = self.attention_norm(x)
        if isinstance(self.mixer, Attention):
            x = x + self.mixer(normed, rope, ctx)
        else:
            x = x + self.mixer(normed, ctx)  # position enters through the scan order
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder. `seed` initialises weights deterministically (on any device); None
    is for loaders that assign every tensor anyway: the embedding is left empty and
    the rest has torch's default init."""

    def __init__(self, config: ModelConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        # An empty embedding weight skips its default normal_ init, which on the meta
        # device a loader builds on imports torch._dynamo (about 0.8 s per process).
        empty = torch.empty(config.vocab_size, config.hidden_size) if seed is None else None
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if seed is not None:
            self.init_weights(seed)

    @property
    def supports_state_snapshots(self) -> bool:
        """True when every recurrent layer hands out per-token states for snapshots."""
        return all(block.mixer.supports_snapshots for block in self.layers
                   if isinstance(block.mixer, Recurrence))

    def tie_weights(self) -> None:
        """Make the output projection share the embedding when the config ties them."""
        if self.config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Overwrite every parameter from `seed` (mutates the model).

        Linear and embedding weights ~ N(0, std), norms 1, recurrent decay logits
        ~ U(0, 4) (a in 0.5..0.98: slow enough that state from earlier chunks matters).
        Values are drawn on the CPU, so every device gets the same weights.
        """
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():  # tied weights are listed once
            # device="cpu" explicitly: a `with torch.device(...)` around the constructor
            # must not move the draws off the generator's device.
            if name.endswith("norm.weight"):
                value = torch.ones(param.shape, device="cpu")
            elif name.endswith("decay"):
                value = torch.rand(param.shape, generator=generator, device="cpu") * 4
            else:
                value = torch.randn(param.shape, generator=generator, device="cpu") * std
            param.copy_(value)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Run one step over T new tokens; returns float32 logits [N, vocab].

        input_ids, positions: [T] (absolute positions, used by RoPE). N is
        len(logits_indices), or T when it is None. Mutates nothing but the engine's state
        through `ctx`. Raises ValueError when the shapes and ctx.seq_lens disagree.
        """
        _check_step(input_ids, positions, ctx.seq_lens)
        x = self.tok_embeddings(input_ids)  # [T, hidden]
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for block in self.layers:
            x = block(x, rope, ctx)
        if logits_indices is not None:
            x = x[logits_indices]  # [N, hidden]
        return self.output(self.norm(x)).float()  # [N, vocab]


def _check_step(input_ids: Tensor, positions: Tensor, seq_lens: list[int]) -> None:
    if input_ids.ndim != 1 or input_ids.shape != positions.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
            "must both be [T]"
        )
    if input_ids.dtype.is_floating_point or positions.dtype.is_floating_point:
        raise ValueError(
            f"input_ids ({input_ids.dtype}) and positions ({positions.dtype}) must be integer"
        )
    if not input_ids.shape[0] or sum(seq_lens) != input_ids.shape[0] or min(seq_lens) < 0:
        raise ValueError(
            f"ctx.seq_lens={seq_lens} must be non-negative and sum to T={input_ids.shape[0]} > 0"
        )
