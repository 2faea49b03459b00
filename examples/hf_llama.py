"""Your own transformers Llama on your own data, in tensor x pipeline parallel (cpu_tp2_pp2, 4 processes):

    torchrun --nproc_per_node 4 examples/hf_llama.py
    deepspeed --num_gpus 4 examples/hf_llama.py
    accelerate launch --multi_gpu --num_processes 4 examples/hf_llama.py
"""
import argparse
from pathlib import Path

import torch
import transformers

import plugin
from plugin.data.files import read_documents
from plugin.data.packing import pack
from plugin.data.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
p = argparse.ArgumentParser()
p.add_argument("--recipe", default="cpu_tp2_pp2")
p.add_argument("--data", default=str(DATA / "corpus" / "stdlib_docs.jsonl"))
p.add_argument("--tokenizer", default=str(DATA / "tokenizer"))
p.add_argument("--steps", type=int, default=20)
p.add_argument("--save", default="hf_llama_ckpt")
args, _ = p.parse_known_args()  # the deepspeed launcher adds --local_rank

recipe = plugin.load_recipe(args.recipe)
tokenizer = load_tokenizer(args.tokenizer, model_vocab=512)
windows = pack(tokenizer.encode(read_documents([args.data])[:400]), tokenizer.eos_id, recipe.model.seq_len)
torch.manual_seed(0)  # the same whole model on every rank: the plugin shards it
config = transformers.LlamaConfig(vocab_size=512, hidden_size=recipe.model.hidden, intermediate_size=256,
                                  num_hidden_layers=recipe.model.layers, num_attention_heads=recipe.model.heads,
                                  num_key_value_heads=2, max_position_embeddings=recipe.model.seq_len)
model = transformers.LlamaForCausalLM(config)
engine = plugin.initialize(model, recipe)
loader = engine.dataloader(windows, seed=0)  # {"input_ids", "labels"}: labels shifted inside the loss
for step, batch in zip(range(args.steps), loader.stream(), strict=False):
    loss = engine.train_step(batch)
    if engine.is_main:
        print(f"step {step + 1}: loss {loss:.4f}", flush=True)
engine.save(args.save, client_state={"data": loader.state_dict()})
engine.close()
