"""What a bucket of the step loop binds, and the bounded LRU that keeps the bindings.

A binding is a graph's inputs and outputs bound by address once (its captured CUDA graph on a
GPU): :func:`bind_step` binds the step graph to the first rows of a RowScheduler's (row_scheduler.py)
resident slots, :func:`bind_blend` the ``latent_blend`` graph; :class:`BindingCache` keeps one per
bucket key (rows, given rows, sets) and frees the ones it evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator

from ..engine.backend import Binding
from ..engine.device import TensorView
from .rows import SchedulerStats


class BindingCache:
    def __init__(self, limit: int, stats: SchedulerStats):
        self.limit = limit
        self.stats = stats  # bindings_made, bindings_freed
        self._items: OrderedDict[Hashable, Binding] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Binding]) -> Binding:
        binding = self._items.get(key)
        if binding is not None:
            self._items.move_to_end(key)
            return binding
        binding = self._items[key] = make()
        self.stats.bindings_made += 1
        while len(self._items) > self.limit:
            _, old = self._items.popitem(last=False)
            old.free()
            self.stats.bindings_freed += 1
        return binding

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Binding]:
        return iter(list(self._items.values()))

    def free(self) -> None:
        for binding in self._items.values():
            binding.free()
        self._items.clear()


def bind_step(s: Any, n: int, e: int, m: int, shallow: bool = False, adapters: bool = True) -> Binding:
    """The step graph bound to the slots' first ``n`` rows, the last ``e`` of them given their
    unconditional prediction, ``m`` negative-prompt sets; its maps and deep features outputs too
    (every output is bound: an unbound one would be allocated by the runtime on every call).
    ``shallow``: the DeepCache variant, which reads the deep features the full step wrote to the
    same buffer for the same ``(n, e)`` (the UNet's rows ``[n - e uncond; n cond]``).
    ``adapters`` False (no row of the call uses one): the adapter slots bound zero wide."""
    sig = s.sig
    latent = lambda rows: (rows, *s.latent_shape)  # noqa: E731
    deep = s.dev["deep"].view((2 * n - e, *s.deep_shape))
    views: dict[str, TensorView] = {
        sig.latents: s.dev[sig.latents].view(latent(n)),
        sig.entry_uncond: s.dev[sig.entry_uncond].view(latent(e)),
        sig.entry_slope: s.dev[sig.entry_slope].view((e,)),
        sig.set_index: s.dev[sig.set_index].view((n,)),
        sig.row_ref: s.dev[sig.row_ref].view((n,)),
        sig.step_coefs: s.dev[sig.step_coefs].view((n, *s.specs[sig.step_coefs][1:])),
        sig.history: s.dev[sig.history].view((n, 2, *s.latent_shape)),
        sig.step_noise: s.dev[sig.step_noise].view(latent(n)),
        **{name: s.dev[name].view((n,)) for name in [*sig.step_scalars, *sig.row_scalars]},
        **{name: s.dev[name].view((n, *s.specs[name][1:])) for name in s.row_kv},
        **{name: s.dev[name].view(s.uncond.shape(name, m)) for name in s.uncond.set_kv},
        **{name: s.dev[name].view((n, *s.specs[name][1:])) for name in s.row_cond},
        **{name: s.dev[name].view((m, *s.specs[name][1:])) for name in s.uncond.set_cond},
        **{name: s.dev[name].view(s.adapter_shape(name, adapters)) for name in sig.adapter_weights},
    }
    if sig.row_adapters is not None:  # each row's scales, slots wide (its slot's stride in the buffer)
        views[sig.row_adapters] = s.dev[sig.row_adapters].view((n, *s.adapter_shape(sig.row_adapters, adapters)[1:]))
    graph, target = (s.shallow_graph, s.shallow_sig) if shallow else (s.graph, sig)
    views[target.deep_in or sig.deep_out] = deep
    missing = set(target.inputs) - set(views)
    if missing:  # a role this loop does not fill: the manifest is newer than the runtime
        raise RuntimeError(f"unet_step inputs {sorted(missing)} have roles the step loop does not know")
    outputs = {name: s.dev[name].view(latent(n)) for name in (sig.next_latents, sig.uncond_out)}
    outputs[sig.history_out] = s.dev[sig.history_out].view((n, 2, *s.latent_shape))
    if not shallow:
        outputs[sig.deep_out] = deep
        if s.has_maps:
            outputs[sig.attn_maps] = s.dev[sig.attn_maps].view((n, s.text_len, *s.map_hw))
    return graph.bind({name: views[name] for name in target.inputs}, outputs)


def bind_blend(s: Any, n: int) -> Binding:
    """``latent_blend`` bound to the first ``n`` rows: the step's next latents, the masks, the
    bases, the corrections (latent_blend's own inputs), its history -> the step's input latents
    and history."""
    latent, history = (n, *s.latent_shape), (n, 2, *s.latent_shape)
    inputs = {"next_latents": s.dev[s.sig.next_latents].view(latent), "keep": s.dev["keep"].view((n, 1, *s.latent_shape[1:])),
              "base": s.dev["base"].view(latent), "add": s.dev["add"].view(latent),
              "history_out": s.dev[s.sig.history_out].view(history)}  # fmt: skip
    outputs = {"latents": s.dev[s.sig.latents].view(latent), "history": s.dev[s.sig.history].view(history)}
    return s.blend_graph.bind(inputs, outputs)
