"""kernels.cudnn_attention: float8 attention by cuDNN's fused SDPA (the cudnn-frontend package's graph API),
the kernel `kernels.fp8_attention_kernel` picks (`auto`: cuDNN's where it runs, else the Triton kernel of
pipeline/kernels/fp8_attention.py) for the attentions whose output goes to float8 layers only.

The queries and keys are quantized as for the Triton kernel: by fixed scales, the bounds their RMS norms
put on them (attention_inputs' qk kernel, `rotated_qk` with scales). cuDNN's float8 SDPA takes one scale
per tensor, so the values are quantized by one scale per batch row, from the absolute maximum of that
row's values over all its heads and tokens (`quantize_values`), and each batch row is its own cuDNN call:
a row's bytes do not depend on the batch's other rows. The probabilities are scaled by 2^P_SHIFT before
their float8 cast, as the Triton kernel's are. On Hopper cuDNN writes a float8 attention's output in
float8 only: each row divided by its output scale (its largest value scale times OUT_HEADROOM, as
`fp8_attention.output_scale`), which the float8 out-projections read as their rows and scales.

One cuDNN graph per (tokens, heads, head dim, device), built at its first call; cuDNN's heuristics pick
its engine (the same in every process on the same GPU model and cuDNN). It runs on torch's current
stream, so our CUDA graphs capture it. The CPU runs `reference`: the same quantized inputs,
dequantized, through float32 attention. Needs a GPU of compute capability 9.0 or newer, cuDNN
MIN_CUDNN or newer (torch's) and the package nvidia-cudnn-frontend (the `cudnn` extra).
"""

from __future__ import annotations

import functools
import logging

import torch

from pipeline.kernels import attention_inputs, fp8
from pipeline.kernels.fp8_attention import OUT_HEADROOM, P_SHIFT

log = logging.getLogger(__name__)

MIN_CUDNN = 91300  # cuDNN's first version with float8 SDPA forward
MIN_CAPABILITY = (9, 0)
INSTALL = "pip install 'bcg-datagen[cudnn]' (the nvidia-cudnn-frontend package)"
SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
HEAD_DIMS = (32, 64, 128)  # the head widths its cuda tests and benchmarks ran (others take the Triton kernel)


def kernel_for(kernel: str, head_dim: int, rows_out: bool) -> str:
    """The kernel one float8 attention runs where the plan chose `kernel`: cuDNN's only where its output
    goes to float8 layers (`rows_out`: cuDNN writes float8 only) and its heads are of HEAD_DIMS, else
    the Triton kernel (a width cuDNN has not run: said once)."""
    if kernel != "cudnn" or not rows_out:
        return "triton"
    if head_dim not in HEAD_DIMS:
        fp8.say_once(__name__, f"kernels: float8 attention of heads {head_dim} wide runs the Triton kernel: cuDNN's "
                               f"has run at {list(HEAD_DIMS)} only")
        return "triton"
    return "cudnn"


@functools.cache
def unavailable(device: torch.device) -> str | None:
    """None where cuDNN's float8 attention runs on this device, else why not (for the log and refusals)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it runs on CUDA, this job on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"it needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+, this GPU has " \
               f"{capability[0]}.{capability[1]}"
    version = torch.backends.cudnn.version() or 0
    if version < MIN_CUDNN:
        return f"it needs cuDNN {MIN_CUDNN} or newer, torch has {version}"
    try:
        import cudnn
    except ImportError as exc:
        return f"the cudnn-frontend package does not import ({exc}): {INSTALL}"
    if cudnn.backend_version() < MIN_CUDNN:
        return f"it needs cuDNN {MIN_CUDNN} or newer, cudnn-frontend loaded {cudnn.backend_version()}"
    return None


def setting() -> str:
    """What sets the bytes of its outputs (in the kernel settings' digest): cuDNN's and the frontend's
    versions, the probabilities' shift, the outputs' headroom and the inputs' kernels."""
    import cudnn

    return (f"cudnn-{torch.backends.cudnn.version()}-fe{cudnn.__version__}-p{P_SHIFT}-rows{OUT_HEADROOM}-rowscale"
            f"+{attention_inputs.SETTING}")


def quantize_values(value: torch.Tensor, text_value: torch.Tensor | None, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The image's (or a single block's) values [B, S_i, H*D] and a double block's text values [B, S_t, H*D]
    (else None) -> the joined values (text first) as float8 [B, S, H, D] and each batch row's scale
    float32 [B]: its absolute maximum over all heads and tokens / 448."""
    return quantize_row_scaled(value if text_value is None else torch.cat([text_value, value], dim=1), heads)


def quantize_row_scaled(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries, keys or values [B, S, H*D] (any strides) -> float8 [B, S, H, D] contiguous and each batch row's
    scale float32 [B]: its absolute maximum over all heads and tokens / 448 (a maximum is exact in any order:
    the scale does not depend on how the reduction splits, nor on the batch's other rows)."""
    # each token's maximum first, then the row's: a reduction per token (many programs), then a short one,
    # where one reduction over a whole row leaves a few programs to read it all
    scale = t.abs().amax(dim=2).amax(dim=1).float().clamp(min=fp8.MIN_AMAX) / fp8.FP8_MAX
    t8 = (t.float() / scale[:, None, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return t8.unflatten(-1, (heads, -1)).contiguous(), scale


def output_scale(v_scale: torch.Tensor) -> torch.Tensor:
    """Each batch row's value scale [B] -> its output's float8 scale [B]: an output is an average of the
    values, so no output exceeds the largest value; times OUT_HEADROOM for the probabilities' rounding."""
    return v_scale * OUT_HEADROOM


def scalars(qk_scales: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The queries' and keys' scales [2] and each batch row's value scale [B] -> cuDNN's scalars for each
    row [B, len(SCALARS), 4], each in a 16-byte slot of its own (the scalar first): the queries' and keys'
    scales, the row's value scale, the probabilities' 2^-P_SHIFT and 2^P_SHIFT, 1 / the row's output
    scale. Torch ops, which inductor fuses into the blocks' kernels."""
    ones = torch.ones_like(v_scale, dtype=torch.float32)
    shift = 2.0 ** P_SHIFT
    values = torch.stack([qk_scales[0] * ones, qk_scales[1] * ones, v_scale * ones, ones / shift, ones * shift,
                          1 / output_scale(v_scale)], dim=1)
    return torch.nn.functional.pad(values[..., None], (0, 3))


def attention_rows(q8, k8, v8, qk_scales, v_scale, softmax_scale: float, text_tokens: int) -> tuple:
    """Float8 queries, keys and values [B, S, H, D] (the first `text_tokens` tokens the text's), the queries'
    and keys' scales [2], each batch row's value scale [B] -> the attention as float8 rows for float8
    layers: text rows [B, S_t, H*D], their scales [B*S_t, 1], image rows, their scales (the rows views of
    the op's one output)."""
    out = torch.ops.bcg.cudnn_fp8_attention(q8, k8, v8, scalars(qk_scales, v_scale), softmax_scale)
    return _rows(out, output_scale(v_scale), text_tokens)


def rows_reference(q8, k8, v8, qk_scales, v_scale, softmax_scale: float, text_tokens: int) -> tuple:
    """`attention_rows`' result from float32 attention of the dequantized inputs (unrounded probabilities)."""
    return _rows(reference(q8, k8, v8, scalars(qk_scales, v_scale), softmax_scale), output_scale(v_scale), text_tokens)


def reference(q8, k8, v8, table: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """`cudnn_fp8_attention` in float32 from the dequantized inputs -> float8 rows [B, S, H*D]."""
    scale = table[:, :, 0]  # [B, scalars]
    q, k, v = (t.float().transpose(1, 2) * scale[:, i, None, None, None] for i, t in enumerate((q8, k8, v8)))
    out = (torch.softmax(q @ k.transpose(2, 3) * softmax_scale, dim=-1) @ v).transpose(1, 2).flatten(2)
    return (out * scale[:, 5, None, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)


def _rows(x8: torch.Tensor, x_scale: torch.Tensor, text_tokens: int) -> tuple:
    """Output rows [B, S, C] and each batch row's scale [B] -> (text rows, scales, image rows, scales)."""
    batch, tokens, _ = x8.shape
    return tuple(part for rows in (x8[:, :text_tokens], x8[:, text_tokens:])
                 for part in (rows, x_scale[:, None].expand(batch, rows.shape[1]).reshape(-1, 1).contiguous()))


@torch.library.custom_op("bcg::cudnn_fp8_attention", mutates_args=())
def cudnn_fp8_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, table: torch.Tensor,
                        softmax_scale: float) -> torch.Tensor:
    """Float8 queries, keys and values [B, S, H, D], each batch row's scalars [B, len(SCALARS), 4]
    (`scalars`) -> the attention [B, S, H*D] in float8, each row times its 1 / output scale. An
    operator torch.compile calls as it is."""
    if q8.device.type != "cuda":
        return reference(q8, k8, v8, table, softmax_scale)
    batch, tokens, heads, dim = q8.shape
    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        if t.shape != q8.shape or not t.is_contiguous() or t.dtype != fp8.FP8:
            raise ValueError(f"cudnn_fp8_attention: {name} must be contiguous float8 {list(q8.shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    if table.shape != (batch, len(SCALARS), 4) or not table.is_contiguous() or table.dtype != torch.float32:
        raise ValueError(f"cudnn_fp8_attention: the scalars must be contiguous float32 [{batch}, {len(SCALARS)}, 4]")
    graph = _graph(tokens, heads, dim, softmax_scale, q8.device)
    out = torch.empty((batch, tokens, heads * dim), dtype=fp8.FP8, device=q8.device)
    workspace = torch.empty(graph.workspace, dtype=torch.uint8, device=q8.device)
    graph.stream(torch.cuda.current_stream(q8.device))
    for b in range(batch):  # one call per batch row: its own value and output scales
        graph.run(q8[b], k8[b], v8[b], out[b], table[b, :, 0:1], workspace)
    return out


@cudnn_fp8_attention.register_fake
def _(q8, k8, v8, table, softmax_scale):
    batch, tokens, heads, dim = q8.shape
    return q8.new_empty((batch, tokens, heads * dim))


class _Graph:
    """A cuDNN float8 SDPA graph for one batch row of [S, H, D] queries, keys and values (tokens, then heads,
    contiguous), its output float8 rows [S, H*D], its scalars."""

    def __init__(self, tokens: int, heads: int, dim: int, softmax_scale: float, device: torch.device):
        import cudnn

        self.cudnn = cudnn
        with torch.cuda.device(device):
            self.handle = cudnn.create_handle()
        dims, strides = (1, heads, tokens, dim), (tokens * heads * dim, dim, heads * dim, 1)
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                              handle=self.handle)
        self.q, self.k, self.v = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in "qkv")
        self.scalars = [graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32) for n in SCALARS]
        self.o, _, amax_s, amax_o = graph.sdpa_fp8(q=self.q, k=self.k, v=self.v, **dict(zip(SCALARS, self.scalars)),
                                                   generate_stats=False, attn_scale=softmax_scale,
                                                   use_causal_mask=False)
        self.o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        self.amax = (amax_s, amax_o)
        for amax in self.amax:
            amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.workspace = graph, max(graph.get_workspace_size(), 1)
        self.amax_out = torch.zeros(2, 4, dtype=torch.float32, device=device)  # written, not read

    def stream(self, stream: torch.cuda.Stream) -> None:
        self.cudnn.set_stream(handle=self.handle, stream=stream.cuda_stream)

    def run(self, q8, k8, v8, out, scalars: torch.Tensor, workspace: torch.Tensor) -> None:
        """One batch row: q8, k8, v8 [S, H, D], out [S, H*D], scalars [len(SCALARS), 1] (16-byte apart)."""
        pack = {self.q: q8, self.k: k8, self.v: v8, self.o: out,
                self.amax[0]: self.amax_out[0, 0:1], self.amax[1]: self.amax_out[1, 0:1]}
        pack.update(zip(self.scalars, scalars))
        self.graph.execute(pack, workspace, handle=self.handle)


@functools.cache
def _graph(tokens: int, heads: int, dim: int, softmax_scale: float, device: torch.device) -> _Graph:
    graph = _Graph(tokens, heads, dim, softmax_scale, device)
    log.info("kernels: cuDNN float8 attention built for %d tokens, %d heads of %d (scale %.6g)", tokens, heads, dim,
             softmax_scale)
    return graph

