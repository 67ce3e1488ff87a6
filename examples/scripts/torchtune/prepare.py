"""Make the local assets for the torchtune recipes (no downloads): a tiny sentencepiece
tokenizer trained on ../data/text.txt, and a tiny random Llama-2 checkpoint in torchtune format.

    /tmp/ttvenv/bin/python examples/scripts/torchtune/prepare.py [OUT_DIR]   (default /tmp/peakledger_torchtune)
"""
import os
import sys

import sentencepiece as spm
import torch
from torchtune.models.llama2 import llama2

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "text.txt")
VOCAB = 256  # must match model.vocab_size in the yaml configs


def main(out):
    os.makedirs(os.path.join(out, "model"), exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=TEXT, model_prefix=os.path.join(out, "tokenizer"), vocab_size=VOCAB,
        model_type="bpe", character_coverage=1.0, hard_vocab_limit=False,
        pad_id=-1, unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
    )
    torch.manual_seed(0)
    model = llama2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=4,
                   embed_dim=64, max_seq_len=128)
    torch.save(model.state_dict(), os.path.join(out, "model", "model.pt"))
    print("wrote", os.path.join(out, "tokenizer.model"), "and", os.path.join(out, "model", "model.pt"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/peakledger_torchtune")
