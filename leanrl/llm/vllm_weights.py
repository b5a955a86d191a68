"""Weights into a vLLM engine through vLLM's weight-transfer API (`vllm.distributed.weight_transfer`): `nccl` (a
broadcast from the trainer's GPU to the engine's), `ipc` (CUDA IPC handles, the trainer on the engine's GPU) and,
registered here, `leanrl_safetensors`: the weights as safetensors bytes through the engine's control plane, for CPUs
(vLLM's two are CUDA-only) and any device pair. Each is a worker-side engine inside vLLM's worker and a trainer-side
engine in the process that holds the weights; this module is imported by both (vLLM imports it into every worker as
its `worker_extension_cls`, which registers the worker side there).

The worker loads what it receives with vLLM's layerwise reload, as vLLM's own engines do: on a CPU vLLM repacks
linear weights at load time, so copying into the engine's modules in place would silently do nothing.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from safetensors.torch import load, save
from vllm.distributed.weight_transfer import (ParamMeta, TrainerWeightTransferEngine, WeightSource,
                                              WeightTransferEngine, WeightTransferEngineFactory,
                                              WeightTransferTrainerFactory)
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload import layerwise

SAFETENSORS = "leanrl_safetensors"


@dataclass
class SafetensorsInitInfo(WeightTransferInitInfo):
    """No rendezvous: the bytes ride the control plane."""


@dataclass
class SafetensorsTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = SAFETENSORS


@dataclass
class SafetensorsUpdateInfo(WeightTransferUpdateInfo):
    data: bytes
    """safetensors bytes of the weights under their checkpoint (transformers) names"""


class SafetensorsWeightTransferEngine(WeightTransferEngine[SafetensorsInitInfo, SafetensorsUpdateInfo]):
    """The worker side: each update's bytes loaded between `start_weight_update` and `finish_weight_update`."""

    init_info_cls = SafetensorsInitInfo
    update_info_cls = SafetensorsUpdateInfo

    def init_transfer_engine(self, init_info: SafetensorsInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the base class synchronizes unconditionally: an error on a CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SafetensorsUpdateInfo) -> None:
        self.model.load_weights(load(update_info.data).items())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


class SafetensorsTrainerWeightTransferEngine(TrainerWeightTransferEngine[SafetensorsTrainerInitInfo]):
    """The trainer side: every weight of the source, on the host, in one update."""

    init_info_cls = SafetensorsTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: SafetensorsTrainerInitInfo, *, client, source: WeightSource | None = None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        data = save({name: t.to("cpu").contiguous() for name, t in self.source})
        self.client.start_weight_update()
        self.client.update_weights({"data": data})
        self.client.finish_weight_update()


class ParamsSource(WeightSource):
    """The weights of a TensorDict of parameters (`from_module(model).data`) under the checkpoint's `names`; a tensor
    under two names (tied embeddings) goes once, as the checkpoint holds it."""

    def __init__(self, params, names: set[str]):
        self._params, self._names = params, names

    def _items(self) -> list[tuple[str, torch.Tensor]]:
        seen, items = set(), []
        for name, t in self._params.flatten_keys(".").items():
            if name in self._names and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                items.append((name, t.detach()))
        return items

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._items())


class EngineClient:
    """vLLM's weight-sync control plane (its `VLLMWeightSyncClient` protocol) on an `LLM` this process drives: each
    call runs on the engine's workers between two engine steps."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs=dict(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", kwargs=dict(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.llm.llm_engine.set_weight_version(weight_version)


class Registered:
    """vLLM's `worker_extension_cls`: naming it makes each worker import this module, which registers the
    safetensors engine in the worker's process. It adds no method to the worker."""


def _not_rope(record: logging.LogRecord) -> bool:
    """vLLM 0.32's layerwise reload counts RoPE's cos/sin cache as a weight, finds it in no checkpoint, warns
    "RotaryEmbedding: Failed to load weights" at every update and puts the same cache back: a false alarm."""
    return not (record.msg == "%s: Failed to load weights" and str(record.args[0]).endswith("RotaryEmbedding"))


layerwise.logger.addFilter(_not_rope)
WeightTransferEngineFactory.register_engine(SAFETENSORS, SafetensorsWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(SAFETENSORS, SafetensorsTrainerWeightTransferEngine)
