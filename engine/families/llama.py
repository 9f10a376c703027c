"""Llama and Mistral: the graph every other family is described against."""

from engine.families.base import Family

LLAMA = Family(
    name="llama",
    gguf_archs=("llama",),
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    gguf_permuted_qk=True,
)
