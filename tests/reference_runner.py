"""A Polygraphy runner for a torch module on the CPU (Polygraphy's PytRunner moves to CUDA)."""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata


class TorchCpuRunner(BaseRunner):
    def __init__(self, module: torch.nn.Module, input_metadata: TensorMetadata, output_names: list[str]):
        super().__init__(prefix="torch-cpu-runner")
        self.module = module
        self.input_metadata = input_metadata
        self.output_names = output_names

    def activate_impl(self):
        self.module.eval()

    def get_input_metadata_impl(self):
        return self.input_metadata

    def infer_impl(self, feed_dict):
        with torch.no_grad():
            start = time.perf_counter()
            outputs = self.module(*(torch.from_numpy(v) for v in feed_dict.values()))
            self.inference_time = time.perf_counter() - start
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        return OrderedDict((name, out.numpy()) for name, out in zip(self.output_names, outputs))

    def deactivate_impl(self):
        pass
