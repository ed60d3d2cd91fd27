"""Megatron-Bridge recipes, shrunk, trained by Bridge's own ``pretrain()`` on gloo ranks.

A test builds a recipe by its name, shrinks it with Bridge's own override mechanism
(``process_config_with_overrides``, Hydra syntax), and runs Bridge's ``pretrain()`` with
``gpt_step.forward_step`` on the ranks of a ``GlooPool``:

    from lrmoe_testing import bridge as harness

    runs = pool.run(harness.train, harness.QWEN3_30B_A3B_8GPU, harness.EP2, timeout=300)
    runs[0].losses                  # one float per step, this rank's view

    # LRMoE: a module-level convert(cfg) runs after the recipe is built (and, on CPU,
    # given its local spec), before the overrides, as ``enable_lrmoe`` is meant to be used:
    pool.run(harness.train, recipe, [...], convert=my_module.enable, callbacks=my_module.cbs)

    # save at step 10, resume to 20 (directories shared by the ranks):
    pool.run(harness.train, recipe, [*ovr, *harness.checkpoint_overrides(save=d, interval=10)])
    pool.run(harness.train, recipe, [*ovr, *harness.checkpoint_overrides(load=d)])

SFT recipes train with Bridge's ``finetune`` (``run_pretrain(cfg, callbacks, finetune=True)``)
from a checkpoint, on a local dataset (``write_sft_dataset``) with an offline text tokenizer
(``save_text_tokenizer``), both given by overrides.

What is CPU-only (nothing of it on a CUDA machine): the CPU runtime with Bridge's fixes
(``enable_bridge_cpu_runtime``), the local (non-TE) layer spec in place of the recipe's TE
spec (``use_local_spec``), and the local backend of Bridge's MTP block spec, which Bridge
builds with TE hard-coded (``local_mtp_block_spec``). ``CPU_OVERRIDES`` holds what a CPU
run of a bf16 GPU recipe needs (fp32, no fused kernels, gloo, no distributed optimizer),
``SMALL`` the width and depth, ``EP2`` both at expert parallelism 2. The recipes read
their HF ``config.json`` from the pre-filled cache of ``lrmoe_testing/hf_cache.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_lrmoe.integration.runtime.compat import stub_bridge_imports_of_absent_modules
from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime
from megatron_lrmoe.megatron_privates import (
    clear_mtp_loss_tracker,
    swapped_bridge_mtp_block_spec,
)

QWEN3_30B_A3B_8GPU = "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config"
QWEN3_30B_A3B_16GPU = "qwen3_30b_a3b_pretrain_config"   # Bridge's alias of the 16 x H100 one
QWEN3_30B_A3B_SFT_8GPU = "qwen3_30b_a3b_sft_8gpu_h100_bf16_config"
GLM45_AIR = "glm45_air_106b_pretrain_config"
NEMOTRON_3_NANO = "nemotron_3_nano_pretrain_config"   # Bridge's alias of the 8 x H100 one
DEEPSEEK_V3 = "deepseek_v3_pretrain_config"    # Bridge's alias of the 1024 x H100 one
GLM45_355B = "glm45_355b_pretrain_config"
QWEN3_235B_A22B = "qwen3_235b_a22b_pretrain_config"
DEEPSEEK_V2 = "deepseek_v2_pretrain_config"
NEMOTRON_3_NANO_GB200 = "nemotron_3_nano_gb200_pretrain_config"
NEMOTRON_3_5_LIGHTNING = "nemotron_3_5_lightning_pretrain_config"
EXAONE_MOE = "exaone_moe_236b_a23b_pretrain_config"
OLMOE_7B = "olmoe_7b_pretrain_config"

#: Width of a CPU test model (every recipe; the depth is the recipe's shape, ``SHAPES``),
#: one micro-batch per step per rank.
SMALL: list[str] = [
    "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.moe_ffn_hidden_size=32", "model.num_moe_experts=4", "model.moe_router_topk=2",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=16",
    "model.seq_length=32", "dataset.seq_length=32",
    "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null",
    "tokenizer.vocab_size=256", "train.train_iters=20", "train.global_batch_size=4",
    "train.micro_batch_size=1", "scheduler.lr_decay_iters=20", "scheduler.lr_warmup_iters=2",
    "validation.eval_interval=1000", "validation.eval_iters=0", "logger.log_interval=5",
    "logger.tensorboard_dir=null", "checkpoint.save=null", "checkpoint.load=null",
    "rng.seed=1234",
]

#: Depth and shape of a shrunk recipe, by recipe-name prefix: GLM-4.5 keeps its dense first
#: layer, a shared expert and one MTP layer; DeepSeek-V3 too (its recipe's one MTP layer
#: kept), with its multi-latent attention's ranks and head dims shrunk and its router's
#: expert groups fitted to 4 experts (2 groups of 2, tokens routed within 1), and DeepSeek-V2
#: shrunk alike (it has no MTP layer); Nemotron-3.5 Lightning as Nemotron-3 Nano (its two MTP
#: layers kept); the others (Qwen3-MoE, OLMoE: every layer MoE) two layers.
GLM_SHAPE: list[str] = [
    "model.num_layers=3", "model.moe_layer_freq=[0,1,1]",
    "model.moe_shared_expert_intermediate_size=32", "model.mtp_num_layers=1",
]
#: Nemotron-3 Nano: its shared expert, attention then MoE layers in its pattern's order,
#: without its Mamba layers (their kernels are GPU-only: ``lrmoe_testing/local_hybrid.py``).
NEMOTRON_3_NANO_SHAPE: list[str] = [
    "model.hybrid_layer_pattern=*E*E", "model.num_layers=4",
    "model.moe_shared_expert_intermediate_size=32",
]
DEEPSEEK_V3_SHAPE: list[str] = [
    "model.num_layers=3", "model.moe_layer_freq=[0,1,1]",
    "model.moe_shared_expert_intermediate_size=32", "model.q_lora_rank=32",
    "model.kv_lora_rank=16", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8",
    "model.v_head_dim=16", "model.moe_router_num_groups=2", "model.moe_router_group_topk=1",
]
#: EXAONE-MoE: its first four layers (one dense; sliding-window attention with RoPE on three,
#: full attention without RoPE on the fourth), a shared expert and its one (dense) MTP layer.
EXAONE_MOE_SHAPE: list[str] = [
    "model.num_layers=4", "model.moe_layer_freq=[0,1,1,1]", "model.no_rope_freq=[0,0,0,1]",
    "model.window_attn_skip_freq=[1,1,1,0]", "model.moe_shared_expert_intermediate_size=32",
    "model.mtp_num_layers=1",
]
SHAPES: dict[str, list[str]] = {"glm45": GLM_SHAPE, "exaone_moe": EXAONE_MOE_SHAPE,
                                "nemotron_3_nano": NEMOTRON_3_NANO_SHAPE,
                                "nemotron_3_5_lightning": NEMOTRON_3_NANO_SHAPE,
                                "deepseek_v3": DEEPSEEK_V3_SHAPE,
                                "deepseek_v2_pretrain": DEEPSEEK_V3_SHAPE,
                                "": ["model.num_layers=2"]}

#: What a CPU run of a bf16 GPU recipe needs: fp32, no fused kernels (TE, apex), gloo, the
#: all-to-all dispatcher (DeepEP and HybridEP, the flex backends, are CUDA-only), no
#: recompute (a memory choice), no distributed optimizer (its checkpoint needs TE's fused
#: Adam state) and so no precision-aware optimizer (TE's FusedAdam, DeepSeek-V3's recipe;
#: fp32 moments and main grads), no parallelism but EP (CP too: Megatron's local attention
#: refuses CP > 1), data workers in the rank's process,
#: Megatron's RNG tracker (not TE's).
CPU_OVERRIDES: list[str] = [
    "model.tensor_model_parallel_size=1", "model.pipeline_model_parallel_size=1",
    "model.pipeline_model_parallel_layout=null",
    "model.context_parallel_size=1", "model.sequence_parallel=false",
    "model.pipeline_dtype=null", "mixed_precision=null", "model.bf16=false",
    "optimizer.bf16=false", "model.params_dtype=fp32", "ddp.overlap_grad_reduce=false",
    "ddp.overlap_param_gather=false", "ddp.use_distributed_optimizer=false",
    "optimizer.use_distributed_optimizer=false", "optimizer.use_precision_aware_optimizer=false",
    "optimizer.main_grads_dtype=fp32", "optimizer.exp_avg_dtype=fp32",
    "optimizer.exp_avg_sq_dtype=fp32", "dataset.num_workers=0",
    "model.recompute_granularity=null", "model.recompute_method=null",
    "model.recompute_num_layers=null", "model.cross_entropy_loss_fusion=false",
    "model.gradient_accumulation_fusion=false", "model.masked_softmax_fusion=false",
    "model.bias_activation_fusion=false", "model.apply_rope_fusion=false",
    "model.persist_layer_norm=false", "model.moe_grouped_gemm=false",
    "model.moe_permute_fusion=false", "model.moe_token_dispatcher_type=alltoall",
    "model.moe_flex_dispatcher_backend=null", "dist.distributed_backend=gloo",
    "train.manual_gc=false", "model.use_te_rng_tracker=false", "rng.te_rng_tracker=false",
]

#: After ``SMALL`` (which sets 2 query groups for its 4 heads), for the models without
#: grouped-query attention: MLA's (a key head per query head) and OLMoE's (its QK norms span
#: all heads, so its keys must be as wide as its queries).
GROUP_PER_HEAD: list[str] = ["model.num_query_groups=4"]

#: A shrunk recipe on two ranks at expert parallelism 2 (on CPU: gloo and fp32).
EP2: list[str] = [*SMALL, "model.expert_model_parallel_size=2",
                  "model.expert_tensor_parallel_size=1"]


def cpu() -> bool:
    """Whether this process runs without CUDA (the CPU-only parts of the harness apply)."""
    return not torch.cuda.is_available()


def recipe_overrides(recipe: str, overrides: Sequence[str]) -> list[str]:
    """``overrides`` after what the device and the recipe's shape add: ``CPU_OVERRIDES`` on
    CPU, the recipe's ``SHAPES`` entry (the longest prefix of its name)."""
    prefix = max((p for p in SHAPES if recipe.startswith(p)), key=len)
    return [*(CPU_OVERRIDES if cpu() else []), *SHAPES[prefix], *overrides]


def checkpoint_overrides(save: str | None = None, load: str | None = None,
                         interval: int | None = None, async_save: bool = False) -> list[str]:
    """Overrides for Bridge's checkpointing: save to ``save`` every ``interval`` steps,
    resume from ``load`` (its latest iteration). torch_dist format; synchronous saves
    unless ``async_save`` (Bridge's persistent worker process)."""
    out = ["checkpoint.ckpt_format=torch_dist", f"checkpoint.async_save={str(async_save).lower()}"]
    if save is not None:
        out += [f"checkpoint.save={save}", f"checkpoint.save_interval={interval or 1}"]
    if load is not None:
        out += [f"checkpoint.load={load}"]
    return out


#: Token ids of the offline tokenizer (``save_text_tokenizer``): 252 words "0" to "251",
#: then the special tokens, 256 in all (``SMALL``'s vocabulary size).
TEXT_WORDS = 252


def save_text_tokenizer(directory: str) -> None:
    """A word-level Hugging Face tokenizer built offline (the words ``"0"`` to ``"251"``
    split on whitespace, with pad, bos, eos and unk tokens) saved to ``directory``
    (``text_tokenizer_overrides`` use it). SFT datasets need a text tokenizer with those
    special tokens, which ``NullTokenizer`` lacks; the recipes' own come from the Hub."""
    # deferred: optional packages (the SFT tests' tokenizer)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [*map(str, range(TEXT_WORDS)), *specials]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>", unk_token="<unk>").save_pretrained(directory)


def text_tokenizer_overrides(directory: str) -> list[str]:
    """The overrides that make a recipe use the tokenizer ``save_text_tokenizer`` saved in
    ``directory`` (its 256 tokens are the model's vocabulary)."""
    return ["tokenizer.tokenizer_type=HuggingFaceTokenizer",
            f"tokenizer.tokenizer_model={directory}", "tokenizer.hf_tokenizer_kwargs={}",
            "tokenizer.use_tokenizer_vocab_size=true"]


def write_sft_dataset(root: str, examples: int = 64, seed: int = 0) -> None:
    """A prompt-completion SFT dataset in ``root`` (``training.jsonl``, ``validation.jsonl``
    in Bridge's local format, fields ``input`` and ``output``) of words of
    ``save_text_tokenizer``: six random numbers, answered by each plus 100."""
    draw = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    for name, count in (("training.jsonl", examples), ("validation.jsonl", examples // 8)):
        with open(os.path.join(root, name), "w") as f:
            for _ in range(count):
                prompt = [draw.randrange(10, TEXT_WORDS - 100) for _ in range(6)]
                f.write(json.dumps({"input": " ".join(map(str, prompt)),
                                    "output": " ".join(str(x + 100) for x in prompt)}) + "\n")


def sft_dataset_overrides(root: str) -> list[str]:
    """The overrides that make an SFT recipe read the dataset ``write_sft_dataset`` wrote in
    ``root`` in place of its Hub dataset (no offline packing, no validation or test split)."""
    return [f"dataset.dataset_root={root}", "dataset.hf_dataset=null",
            "dataset.hf_validation_proportion=null", "dataset.enable_offline_packing=false",
            "dataset.offline_packing_specs=null", "dataset.dataset_kwargs=null",
            "dataset.do_validation=false", "dataset.do_test=false"]


def recipe_function(name: str) -> Callable[[], Any]:
    """The recipe function Bridge exports as ``megatron.bridge.recipes.<name>``."""
    # deferred: Bridge is optional, imported after the stubs (build_recipe)
    import megatron.bridge.recipes as recipes

    fn = getattr(recipes, name, None)
    if not callable(fn):
        raise ValueError(f"megatron.bridge.recipes has no recipe {name!r}")
    return fn


def use_local_spec(cfg: Any) -> None:
    """The recipe's layer spec in its local (non-TE) flavour, local attention (CPU only:
    Transformer Engine cannot be installed there). A recipe's block-spec builder
    (``functools.partial`` of megatron-core's ``get_gpt_decoder_block_spec``, GLM,
    DeepSeek, MiniMax-M3) gets ``use_transformer_engine=False``; Bridge's default TE layer
    spec becomes its ``local_layer_spec``, OLMoE's ``local_olmoe_layer_spec`` (EXAONE-MoE's
    builds its local flavour itself where TE is absent); a hybrid
    (Mamba) recipe's default stack spec becomes ``local_hybrid_stack_spec``
    (lrmoe_testing/local_hybrid.py). With multi-latent attention, the
    MLA core attention is ``testing.local_mla``'s (megatron-core's local one cannot be built
    for MLA)."""
    # deferred: Bridge (optional, after the stubs) and megatron.core (after the CPU runtime)
    from megatron.bridge.models.exaone.exaone_moe import exaone_moe_provider
    from megatron.bridge.models.gpt_provider import default_layer_spec, local_layer_spec
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.bridge.models.olmoe.olmoe_provider import olmoe_layer_spec
    from megatron.core.transformer.enums import AttnBackend

    from lrmoe_testing.local_mla import with_local_mla_attention

    spec = getattr(cfg.model, "transformer_layer_spec", None)
    if isinstance(cfg.model, HybridModelProvider) and cfg.model.hybrid_stack_spec is None:
        # deferred: hybrid recipes only (it loads Megatron's ModelOpt hybrid specs)
        from lrmoe_testing.local_hybrid import local_hybrid_stack_spec

        cfg.model.hybrid_stack_spec = local_hybrid_stack_spec
    elif isinstance(spec, functools.partial) and "use_transformer_engine" in spec.keywords:
        cfg.model.transformer_layer_spec = functools.partial(
            spec.func, *spec.args, **{**spec.keywords, "use_transformer_engine": False})
    elif spec is default_layer_spec:
        cfg.model.transformer_layer_spec = local_layer_spec
    elif spec is olmoe_layer_spec:
        cfg.model.transformer_layer_spec = local_olmoe_layer_spec
    elif (spec is exaone_moe_provider.ExaoneMoeModelProvider.transformer_layer_spec
          and not exaone_moe_provider.HAVE_TE):
        pass                            # EXAONE-MoE's builds its local flavour without TE
    else:
        raise ValueError(f"no local flavour known for the recipe's layer spec {spec!r}")
    if getattr(cfg.model, "multi_latent_attention", False):
        # megatron-core's local MLA spec needs a core attention taking MLA's head dims.
        cfg.model.transformer_layer_spec = with_local_mla_attention(
            cfg.model.transformer_layer_spec)
    cfg.model.attention_backend = AttnBackend.local
    cfg.model.transformer_impl = "local"


def local_olmoe_layer_spec(config: Any) -> Any:
    """Bridge's ``olmoe_layer_spec`` on the local layer: OLMoE's self-attention (its QK norms
    span all heads) in Bridge's ``local_layer_spec`` in place of its TE one."""
    # deferred: Bridge is optional, imported after the stubs (build_recipe)
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.models.olmoe.olmoe_provider import OLMoESelfAttention

    spec = local_layer_spec(config)
    spec.submodules.self_attention.module = OLMoESelfAttention
    return spec


def local_mtp_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Bridge's MTP block spec with megatron-core's local backend (Bridge hard-codes TE)."""
    # deferred: megatron.core loads after the CPU runtime is on (train)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = config.transformer_layer_spec
    if callable(spec) and not hasattr(spec, "submodules"):
        spec = spec(config, vp_stage=vp_stage) if _takes_vp_stage(spec) else spec(config)
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def _takes_vp_stage(fn: Callable[..., Any]) -> bool:
    return "vp_stage" in inspect.signature(fn).parameters


def build_recipe(recipe: str, overrides: Sequence[str] = (),
                 convert: Callable[[Any], Any] | None = None) -> Any:
    """Bridge's ``recipe`` config: built, on CPU given its local spec, ``convert(cfg)``
    (e.g. ``enable_lrmoe``), then ``recipe_overrides(recipe, overrides)`` through Bridge's
    ``process_config_with_overrides``. Not finalized (``pretrain`` does that)."""
    stub_bridge_imports_of_absent_modules()
    # deferred: Bridge is optional, imported after the stubs
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    cfg = recipe_function(recipe)()
    if cpu():
        use_local_spec(cfg)
    if convert is not None:
        convert(cfg)
    return process_config_with_overrides(cfg, cli_overrides=recipe_overrides(recipe, overrides))


@dataclasses.dataclass
class BridgeRun:
    """What one rank saw of a Bridge ``pretrain()`` run."""

    losses: list[float]                 # "lm loss" after each step, in order
    iterations: list[int]               # the step numbers those losses belong to
    params: dict[str, torch.Tensor]     # this rank's parameters after the last step
    mlps: dict[str, str]                # "<layer>.mlp" module name -> its class name


def _recorder(run: BridgeRun) -> Any:
    # deferred: Bridge is optional, imported after the stubs (build_recipe)
    from megatron.bridge.training.callbacks import Callback

    class Record(Callback):
        def on_train_step_end(self, context: Any) -> None:
            run.losses.append(float(context.loss_dict["lm loss"]))
            run.iterations.append(int(context.state.train_state.step))

        def on_train_end(self, context: Any) -> None:
            model = context.model[0]
            run.params.update({name: p.detach().clone() for name, p in model.named_parameters()})
            run.mlps.update({name: type(m).__name__ for name, m in model.named_modules()
                             if name.endswith(".mlp")})

    return Record()


def run_pretrain(cfg: Any, callbacks: Sequence[Any] = (), finetune: bool = False) -> BridgeRun:
    """Bridge's ``pretrain(cfg, gpt_step.forward_step, callbacks)`` on this rank (its
    ``finetune`` with ``finetune``), with the CPU runtime (and Bridge's CPU fixes) on a
    machine without CUDA."""
    # deferred: Bridge (optional, after the stubs) and megatron.core (after the CPU runtime)
    from megatron.bridge.training import finetune as bridge_finetune
    from megatron.bridge.training import pretrain as bridge_pretrain
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    pretrain = bridge_finetune.finetune if finetune else bridge_pretrain.pretrain

    # A pool worker runs many tasks: whatever an earlier run (or a launcher run that
    # stopped early) left in Megatron's globals, e.g. the rerun state machine, must go; so
    # must the MoE and MTP metric trackers, sized by the first model's layer counts.
    destroy_global_state()
    destroy_moe_metrics_tracker()
    clear_mtp_loss_tracker()
    run = BridgeRun([], [], {}, {})
    every = [*callbacks, _recorder(run)]
    if not cpu():
        pretrain(cfg, forward_step, callbacks=every)
        return run
    with swapped_bridge_mtp_block_spec(local_mtp_block_spec):
        pretrain(cfg, forward_step, callbacks=every)
    return run


def train(recipe: str, overrides: Sequence[str] = (),
          convert: Callable[[Any], Any] | None = None,
          callbacks: Callable[[], Sequence[Any]] | None = None) -> BridgeRun:
    """A pool task: ``build_recipe(recipe, overrides, convert)`` and ``run_pretrain`` on this
    rank. ``convert`` and ``callbacks`` (a factory of Bridge ``Callback`` objects) must be
    module-level functions, since the pool sends them by reference."""
    enable_bridge_cpu_runtime()
    cfg = build_recipe(recipe, overrides, convert)
    return run_pretrain(cfg, callbacks() if callbacks is not None else ())
