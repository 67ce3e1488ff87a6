"""A LightningModule wrapping a tiny Hugging Face causal LM.

Reproduces: the common "HF model inside a LightningModule" fine-tune
(training_step returns model(**batch).loss, configure_optimizers returns AdamW
plus a per-step linear LR schedule) on a tiny random GPT-2, trained with
lightning.Trainer(accelerator="cpu", max_steps=N) without logger, checkpoints
or progress bar, validating every 2 steps. CPU only, no downloads.

    python examples/scripts/lightning_module.py --max-steps 3 --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys
from itertools import chain

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, default_data_collator, get_linear_schedule_with_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer, read_lines, tiny_gpt2_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--output-dir", default="out-lightning")
args = parser.parse_args()


class CausalLMModule(L.LightningModule):
    def __init__(self, config, lr=5e-4, max_steps=3):
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1,
                                                    num_training_steps=self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_blocks(tokenizer, lines, seq_len):
    ids = list(chain(*tokenizer(lines)["input_ids"]))
    n = len(ids) // seq_len * seq_len
    return [{"input_ids": ids[i : i + seq_len], "labels": ids[i : i + seq_len]} for i in range(0, n, seq_len)]


L.seed_everything(42)
tokenizer = load_tokenizer()
lines = read_lines()
train_loader = DataLoader(make_blocks(tokenizer, lines[:-20], args.seq_len), batch_size=args.micro_batch, shuffle=True,
                          collate_fn=default_data_collator)
val_loader = DataLoader(make_blocks(tokenizer, lines[-20:], args.seq_len), batch_size=args.micro_batch,
                        collate_fn=default_data_collator)

module = CausalLMModule(tiny_gpt2_config(tokenizer), max_steps=args.max_steps)
trainer = L.Trainer(
    accelerator="cpu",
    devices=1,
    max_steps=args.max_steps,
    val_check_interval=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=args.output_dir,
)
trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
print("metrics:", {k: round(v.item(), 4) for k, v in trainer.callback_metrics.items()})
