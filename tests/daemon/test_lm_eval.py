"""lm-evaluation-harness, unchanged, against the session's daemon (the real 135M model; issue 47 part 1):
``local-completions`` on a multiple-choice task (loglikelihoods from /v1/completions with echo, token-id
prompts in batches) and ``local-chat-completions`` on a generate_until task, each defined by a task YAML over
a JSONL file written here (no dataset hub is reachable).

Each asserts more than that lm-eval ran: the loglikelihoods it logged are the sums of the daemon's own
echoed token_logprobs, the choice the model decodes greedily wins every question, and its generations are
the daemon's greedy chat answers, so that its score is the one predicted here.

Offline: a loglikelihood task needs a tokenizer on lm-eval's side (it splits context from continuation in
tokens, and sends token ids); it gets the daemon's own, saved to a local folder (``tokenizer`` in the model
args: ``AutoTokenizer.from_pretrained`` of a folder reads no hub). The chat task needs none
(``tokenizer_backend: None``: lm-eval sends the messages and the server applies the chat template).
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from conftest import API_KEY

pytestmark = pytest.mark.slow

LLM = "smollm2"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Scores of the same tokens in other batches (lm-eval sends several prompts per request): the same but for
# rounding (llama.cpp, quantized, on the CPU).
ABS = 2e-3
# Each one's greedy next token is a word (not an end of turn), well ahead of the next.
CONTEXTS = ["The capital of France is", "The miller grinds wheat into", "A dog has four", "The opposite of hot is"]
QUESTIONS = ["What is the capital of France?", "What do bees make?", "What colour is the sky?",
             "Name a big animal."]


def post(server, path, body) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tokenizer_dir(server, tmp_path_factory):
    """The model's own tokenizer, as the engine loaded it, saved where lm-eval can load it offline."""
    path = tmp_path_factory.mktemp("tokenizer")
    server.app.state.services.daemon.pool.slots[LLM].engine.tokenizer.save_pretrained(path)
    return path


def evaluate(tmp_path, task: dict, docs: list[dict], model: str, model_args: dict, **options) -> dict:
    """lm-eval's ``simple_evaluate`` of ``task`` (a YAML written here) over ``docs`` (a JSONL written here)."""
    import lm_eval
    import yaml
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    config = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
              **task}
    (tasks / f"{task['task']}.yaml").write_text(yaml.safe_dump(config))
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    return lm_eval.simple_evaluate(
        model=model, model_args={"model": LLM, "header": HEADERS, "max_retries": 1, **model_args},
        tasks=[task["task"]], task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True, **options)


def choices_for(server, tok, context: str) -> tuple[list[str], int]:
    """Choices of one question: the model's greedy next word, two less likely words (single tokens after the
    context, as lm-eval will tokenize them), and a longer phrase; and where the greedy one is."""
    ids = tok(context, add_special_tokens=False).input_ids
    lp = post(server, "/v1/completions", {"model": LLM, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                          "logprobs": 12})["choices"][0]["logprobs"]
    ranked = sorted(lp["top_logprobs"][0].items(), key=lambda kv: -kv[1])

    def one_word(token: str) -> bool:  # " word", one token after the context: lm-eval sends it so
        return (token[:1] == " " and token[1:].isalpha()
                and tok(context + token, add_special_tokens=False).input_ids[:-1] == ids
                and len(tok(context + token, add_special_tokens=False).input_ids) == len(ids) + 1)

    words = [t for t, _ in ranked if one_word(t)]
    assert words and words[0] == lp["tokens"][0], f"the greedy token {lp['tokens'][0]!r} is no word: {ranked}"
    # Any longer continuation scores at most its first token, below the greedy token: the greedy one must win.
    others = [w[1:] for w in words[1:3]] + ["stone and water wheel"]
    gold = len(context) % (len(others) + 1)
    return others[:gold] + [words[0][1:]] + others[gold:], gold


def test_local_completions_scores_a_multiple_choice_task(server, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    docs = []
    for context in CONTEXTS:
        choices, gold = choices_for(server, tok, context)
        docs.append({"context": context, "choices": choices, "gold": gold})
    task = {"task": "headrace_mill_choice", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "choices", "doc_to_target": "gold", "target_delimiter": " ",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    # batch_size 4: lm-eval sends four token-id prompts per request (echo, logprobs 1, max_tokens 1)
    out = evaluate(tmp_path, task, docs, "local-completions",
                   {"base_url": f"{server.base_url}/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(tokenizer_dir), "tokenized_requests": True, "batch_size": 4})
    assert out["results"]["headrace_mill_choice"]["acc,none"] == 1.0
    samples = out["samples"]["headrace_mill_choice"]
    assert len(samples) == len(docs)
    for sample in samples:
        doc = sample["doc"]
        logged = [resp[0] for resp in sample["resps"]]  # (loglikelihood, is_greedy) per choice
        assert len(logged) == len(doc["choices"])
        # lm-eval's is_greedy (each continuation token the most likely in top_logprobs): the gold choice only
        assert [bool(g) for _, g in logged] == [i == doc["gold"] for i in range(len(logged))]
        for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], logged):
            # The same tokens, scored by the daemon's echo on their own: the sum lm-eval took must be theirs.
            context_ids = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            assert whole[:len(context_ids)] == context_ids
            echo = post(server, "/v1/completions", {"model": LLM, "prompt": whole, "echo": True, "max_tokens": 0,
                                                    "logprobs": 0})["choices"][0]["logprobs"]
            assert len(echo["token_logprobs"]) == len(whole)
            assert loglikelihood == pytest.approx(sum(echo["token_logprobs"][len(context_ids):]), abs=ABS)
        # The greedy word's loglikelihood is the logprob the decode gave it.
        decoded = post(server, "/v1/completions", {"model": LLM, "prompt": doc["context"], "max_tokens": 1,
                                                   "temperature": 0, "logprobs": 0})["choices"][0]["logprobs"]
        assert decoded["tokens"] == [" " + doc["choices"][doc["gold"]]]
        assert logged[doc["gold"]][0] == pytest.approx(decoded["token_logprobs"][0], abs=ABS)
        assert max(ll for ll, _ in logged) == logged[doc["gold"]][0]


def test_local_chat_completions_generates_the_daemons_greedy_answers(server, tmp_path):
    gen = {"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0}
    # What lm-eval will send (checked against its logged arguments below), asked of the daemon first.
    answers = [post(server, "/v1/chat/completions", {
        "model": LLM, "messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0,
        "stop": ["\n"], "seed": 1234})["choices"][0]["message"]["content"] for q in QUESTIONS]
    assert all(answers) and len(set(answers)) > 1
    # The last question's target is not the model's answer: the score must come out 3/4, not "all matched".
    targets = answers[:-1] + ["not what the model says"]
    docs = [{"question": q, "answer": a} for q, a in zip(QUESTIONS, targets)]
    task = {"task": "headrace_mill_answers", "output_type": "generate_until", "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}", "generation_kwargs": gen,
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    out = evaluate(tmp_path, task, docs, "local-chat-completions",
                   {"base_url": f"{server.base_url}/v1/chat/completions", "tokenizer_backend": None,
                    "tokenized_requests": False}, apply_chat_template=True)
    samples = sorted(out["samples"]["headrace_mill_answers"], key=lambda s: s["doc_id"])
    for sample, question, answer in zip(samples, QUESTIONS, answers):
        (prompt, _kwargs), = sample["arguments"]
        prompt = prompt[0] if isinstance(prompt, (tuple, list)) else prompt  # lm-eval's JsonChatStr
        assert json.loads(prompt) == [{"role": "user", "content": question}]
        assert sample["resps"] == [[answer]]
    assert out["results"]["headrace_mill_answers"]["exact_match,none"] == pytest.approx(0.75)
