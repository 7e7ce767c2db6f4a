"""The OpenAI client against ``specdec serve``: an answer, the same answer streamed, and a sampled completion.

Start the server first (in another terminal), then run this:

    .venv/bin/specdec serve --model default --drafter auto --port 8000
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--max-tokens 64]

Greedy answers (temperature 0) are what ``specdec generate`` gives for the prompt alone, however many
requests share the batch; ``usage.specdec`` says how many of the answer's tokens came from accepted drafts.
"""
import argparse

from openai import OpenAI

p = argparse.ArgumentParser()
p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
p.add_argument("--model", default="default", help="the model name the server answers to (its --model-name)")
p.add_argument("--api-key", default="unused", help="the server's --api-key, if it was started with one")
p.add_argument("--max-tokens", type=int, default=64)
args = p.parse_args()

client = OpenAI(base_url=args.base_url, api_key=args.api_key)
question = [{"role": "user", "content": "Name three prime numbers."}]
r = client.chat.completions.create(model=args.model, messages=question, temperature=0, max_tokens=args.max_tokens)
answer = r.choices[0].message.content
print(answer)
print(f"{r.usage.completion_tokens} tokens, {r.usage.specdec['accepted_tokens']} of them from accepted drafts")

stream = client.chat.completions.create(model=args.model, messages=question, temperature=0,
                                        max_tokens=args.max_tokens, stream=True)
streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
print("streamed, the same answer:", streamed == answer)

c = client.completions.create(model=args.model, prompt="The capital of France is", max_tokens=args.max_tokens,
                              temperature=0.7, seed=1)  # a seed repeats a sample, whatever else is running
print(f"completion: {c.choices[0].text!r} ({c.choices[0].finish_reason})")
