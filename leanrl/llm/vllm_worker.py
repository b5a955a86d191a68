"""vLLM worker extension (runs inside vLLM's worker; imports no vLLM itself): load weights sent as safetensors
bytes through vLLM's in-place reload path, which repacks them as the loader does (CPU linear layers included)."""

from safetensors.torch import load


class WeightLoader:
    def leanrl_load_weights(self, data: bytes) -> None:
        """`data`: safetensors bytes of the model's weights under their checkpoint (transformers) names."""
        self.model_runner.reload_weights(weights_iterator=iter(load(data).items()))
