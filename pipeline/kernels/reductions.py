"""kernels.persistent_reductions: inductor keeps every row of a reduction over the last dimension of up
to MAX_VALUES values in one program (a persistent reduction) instead of looping over it.

Inductor generates a persistent reduction only for rows of up to 1,024 values; a wider row (a layer
norm over Flux's 3,072 channels, the float8 quantization of an activation) gets a looped kernel that
reads each row twice, once for its statistics and once to apply them. Persistent, the row is read
once and held in registers. The sum adds in another order, so images may differ by rounding.

How: our choices object answers inductor's question (`should_use_persistent_reduction`) in the thread
that compiles (the one that calls the model), and only for compiles whose options carry `Marker`, a
no-op graph pass whose uuid is in inductor's cache key: a cache never serves one kind of kernel for the
other, and the decoder's compile (no marker) keeps inductor's choice.
"""

from __future__ import annotations

import functools

MAX_VALUES = 16384
OPTION = "post_grad_custom_post_pass"  # inductor's option that carries the marker (part of its cache key)


def compile_options() -> dict:
    """The marker option, and our choices installed in this thread -> options for torch.compile."""
    from torch._inductor.virtualized import V

    marker, choices = _classes()
    if not isinstance(V.choices, choices):
        V.set_choices_handler(choices())
    return {OPTION: marker()}


@functools.cache
def _classes():
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class Marker(CustomGraphPass):
        """Changes no graph; names the setting in inductor's cache key."""

        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return f"bcg-persistent-reductions-{MAX_VALUES}"

    class PersistentChoices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            return (isinstance(getattr(config, OPTION, None), Marker) and config.triton.persistent_reductions
                    and not cooperative_reduction and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, MAX_VALUES))

    return Marker, PersistentChoices
