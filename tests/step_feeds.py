"""The step graph's sampler inputs for a DDIM (eta 0) step, written out from Song et al. 2020,
eq. 12 (x_prev = sqrt(a_prev) x_0 + sqrt(1 - a_prev) eps), for tests that call ``unet_step``
directly: coefficients (runtime/model/step_coefs.COEFS order), no history, no noise."""

import numpy as np


def ddim_feeds(a_prev, n: int, latent_shape) -> dict[str, np.ndarray]:
    a = np.broadcast_to(np.asarray(a_prev, np.float32), (n,))
    zero = np.zeros(n, np.float32)
    coefs = np.stack([zero, np.sqrt(a), np.sqrt(np.float32(1) - a), zero, zero, zero, np.full(n, np.inf, np.float32)], axis=1)
    return {"coefs": coefs.astype(np.float32), "history": np.zeros((n, 2, *latent_shape), np.float32),
            "noise": np.zeros((n, *latent_shape), np.float32)}


def count_step_calls(monkeypatch, run_module) -> list[tuple[int, int]]:
    """Spy on the step graph of every pipeline ``run_module.pipeline_of`` builds: the list it
    returns gets, per call the step graph really runs, (its rows: the latents' batch, the rows
    whose unconditional half it was given: ``uncond_given``'s batch). A count taken at the
    graph itself, independent of the scheduler's own counters."""
    calls: list[tuple[int, int]] = []
    real = run_module.pipeline_of

    def spied(cfg, **overrides):
        pipe = real(cfg, **overrides)
        step = pipe.graphs["unet_step"]
        bind = step.bind

        def counting_bind(inputs, outputs):
            binding = bind(inputs, outputs)
            n, e = inputs["latents"].shape[0], inputs["uncond_given"].shape[0]
            run = binding.run
            binding.run = lambda: (calls.append((n, e)), run())[1]
            return binding

        step.bind = counting_bind
        return pipe

    monkeypatch.setattr(run_module, "pipeline_of", spied)
    return calls
