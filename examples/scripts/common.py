"""Tiny shared helpers for the example training scripts (no downloads)."""
import os

from transformers import GPT2Config, PreTrainedTokenizerFast

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SPECIALS = dict(pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def read_lines(name="text.txt"):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def load_tokenizer():
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(DATA, "tokenizer.json"), **SPECIALS)


def tiny_gpt2_config(tokenizer, n_positions=128):
    return GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def make_model(folder):
    """A local model folder (a tiny random GPT-2 and the tokenizer), as a hub download would leave one."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--make-model"]:
        make_model(sys.argv[2])
        sys.exit(0)
    # Rebuild data/tokenizer.json: byte-level BPE, vocab 500, trained on text.txt.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(read_lines(), trainer)
    tok.save(os.path.join(DATA, "tokenizer.json"))
    print("vocab size", tok.get_vocab_size())
