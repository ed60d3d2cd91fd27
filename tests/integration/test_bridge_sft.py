"""An SFT recipe with LRMoE, trained by Bridge's own ``finetune()`` on two gloo ranks (EP 2):
Qwen3-30B-A3B's 8 x H100 SFT recipe, shrunk like the pretraining recipes, converted by
``enable_lrmoe(cfg, adapt=True)``, fine-tuned from a checkpoint of the shrunk pretraining
recipe (one LRMoE step) on a local prompt-completion dataset with an offline text tokenizer
(the recipe's own dataset, SQuAD, and tokenizer come from the Hugging Face Hub)."""

from __future__ import annotations

import math
import os

from lrmoe_testing import bridge as harness
from tests.integration.test_bridge_training import _enable, _recorder

SFT = harness.QWEN3_30B_A3B_SFT_8GPU
#: Ten SFT steps, at a learning rate at which they move the loss clearly.
SFT_STEPS = ["train.train_iters=10", "scheduler.lr_decay_iters=10", "optimizer.lr=5e-3"]


def pretrain_then_finetune(folder: str) -> dict:
    """A pool task: one step of the LRMoE pretraining recipe saved to ``folder``, then the
    LRMoE SFT recipe fine-tuned from it; what the SFT run saw on this rank."""
    import torch.distributed as dist

    from megatron_lrmoe.integration.bridge import LRMoECallback
    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    checkpoint = os.path.join(folder, "checkpoint")
    tokenizer, data = os.path.join(folder, "tokenizer"), os.path.join(folder, "data")
    if dist.get_rank() == 0:
        harness.save_text_tokenizer(tokenizer)
        harness.write_sft_dataset(data)
    dist.barrier()
    text = harness.text_tokenizer_overrides(tokenizer)
    cfg = harness.build_recipe(harness.QWEN3_30B_A3B_8GPU, [
        *harness.EP2, *text, "train.train_iters=1",
        *harness.checkpoint_overrides(save=checkpoint, interval=1)], convert=_enable)
    harness.run_pretrain(cfg, [LRMoECallback()])
    out: dict = {"losses": []}
    cfg = harness.build_recipe(SFT, [
        *harness.EP2, *text, *harness.sft_dataset_overrides(data), *SFT_STEPS,
        f"checkpoint.pretrained_checkpoint={checkpoint}"], convert=_enable)
    out["dataset"] = type(cfg.dataset).__name__
    harness.run_pretrain(cfg, [LRMoECallback(), _recorder(out)], finetune=True)
    return out


def test_sft_recipe_finetunes_with_lrmoe(gloo2, tmp_path):
    for run in gloo2.run(pretrain_then_finetune, str(tmp_path), timeout=600):
        assert run["dataset"] == "GPTSFTDatasetConfig"
        losses = run["losses"]
        assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses
        assert [cls for _, cls in run["moe"]] == ["LRMoELayer"] * 2
        # The pretrained checkpoint's LRMoE step state is part of the model's state.
        assert run["origin"] == "checkpoint"
