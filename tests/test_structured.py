"""Structured output (llguidance): what a request may ask for, grammars compiled once and
refused clearly, drafts cut where they leave the grammar, and constrained decoding exact
under speculation — greedy equal to greedy without drafts (float32), sampling with drafts
equal in distribution to the target restricted to the grammar (chi-square against the exact
distribution, enumerated with transformers' model and llguidance's masks)."""
from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest
import torch

from specserve import SamplingParams
from specserve.bench.json_schemas import SCHEMA_TASKS
from specserve.structured import StructuredOutputs, allows
from test_logits_process import chi_square_p
from tiny_models import LLM32, save_perturbed

SMALL = dict(max_num_batched_tokens=32, max_num_seqs=16, block_size=4, num_kv_blocks=800)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"enum": ["yes", "no"]}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def near_draft(target, tmp_path_factory):
    return str(save_perturbed(target, tmp_path_factory.mktemp("structured-near"), 0.004))


@pytest.fixture(scope="module")
def eagle_head(target, tmp_path_factory):
    from tiny_models import make_eagle_head

    return make_eagle_head(target, [1], tmp_path_factory.mktemp("structured-eagle"))[0]


def drafters(target: str, near: str, eagle: str | None = None) -> dict[str, dict]:
    return {"none": {}, "ngram": dict(speculative_method="ngram"),
            "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
            "draft-near": dict(speculative_method="draft_model", draft_model=near),
            "eagle": dict(speculative_method="draft_model", draft_model=eagle)}


# ---------------------------------------------------------------------- what may be asked
@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    ({"json": SCHEMA, "regex": "a"}, "exactly one"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"regex": ""}, "regex"),
    ({"json": 5}, "JSON schema"),
    ({"json_object": "yes"}, "json_object"),
])
def test_a_request_asks_for_exactly_one_structure(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**fields)


def test_structure_cannot_be_combined_with_ignore_eos_or_min_tokens():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regexp": "a"})
    assert SamplingParams(structured_outputs={"choice": ["x", "y"]}).structured_outputs.choice == ("x", "y")


@pytest.mark.parametrize("fields, message", [
    ({"regex": "[0-9"}, "regex cannot be used: .*unclosed character class"),
    ({"grammar": "root ::= missing"}, "grammar cannot be used"),
    ({"json": "{not json"}, "JSON schema cannot be used"),
])
def test_a_bad_grammar_is_a_value_error_and_queues_nothing(target, fields, message):
    llm = LLM32(target, **SMALL)
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=message):
        llm.generate(["a", "b"], [good, SamplingParams(max_tokens=4, structured_outputs=fields)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_grammars_are_compiled_once_per_structure(target):
    llm = LLM32(target, **SMALL)
    grammars = llm.engine.grammars
    first = grammars.compile(StructuredOutputs(json=SCHEMA))
    assert grammars.compile(StructuredOutputs(json=dict(SCHEMA))) is first
    assert grammars.compile(StructuredOutputs(json=json.dumps(SCHEMA))) is first  # the same text
    assert grammars.compile(StructuredOutputs(regex="a+")) is not first


# ---------------------------------------------------------------------- drafts and masks
def test_drafts_are_cut_where_they_leave_the_grammar(target):
    llm = LLM32(target, **SMALL)
    tok = llm.tokenizer
    ab, b, c = (tok.convert_tokens_to_ids(t) for t in ("ab", "b", "c"))
    constraint = llm.engine.grammars.constraint(StructuredOutputs(regex="ab+"))
    n, masks = constraint.check_drafts([ab, b, c, b])
    assert n == 2 and masks.shape[0] == 3
    assert allows(masks[0], ab) and not allows(masks[0], b)  # row 0: before any draft
    assert allows(masks[1], b) and not allows(masks[1], c)   # row 1: after "ab"
    assert allows(masks[2], b) and not allows(masks[2], c)   # row 2: after "abb"
    assert constraint.check_drafts([])[0] == 0  # the matcher is back where it began
    assert constraint.check_drafts([b])[0] == 0
    stop = min(llm.engine.eos_token_ids)
    n, masks = constraint.check_drafts([ab, b, stop, b])  # a stop token ends the drafts it allows
    assert n == 3 and masks.shape[0] == 4 and allows(masks[2], stop) and not allows(masks[0], stop)
    assert constraint.check_drafts([stop])[0] == 0   # nothing cannot end yet
    assert constraint.check_drafts([ab, b])[0] == 2  # and the matcher is back at the start


def test_n_gram_drafts_outside_the_grammar_are_never_verified(target):
    """Drafts of a digit then letters under a digits-only grammar: each is cut after the
    digit before the pass, so the target only ever verifies digits."""
    llm = LLM32(target, speculative_method="ngram", speculative_adaptive=False, **SMALL)
    engine, tok = llm.engine, llm.tokenizer
    proposed, verified = [], []
    propose, execute = engine.speculator.drafter.propose, engine.runner.execute

    one, a = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("a")

    def spy_propose(scheduled, requests, stop=None):  # a digit, then letters, whatever n-gram found
        out = propose(scheduled, requests, stop)
        out.draft_token_ids = [[one, a, one][:p.num_lookahead] for p in scheduled]
        proposed.extend(t for d in out.draft_token_ids for t in d)
        return out

    def spy_execute(output, *args, **kwargs):
        verified.extend(t for p in output.scheduled for t in p.draft_token_ids)
        return execute(output, *args, **kwargs)

    engine.speculator.drafter.propose, engine.runner.execute = spy_propose, spy_execute
    out = llm.generate(["a b c a b c a b c a b c a b"], SamplingParams(
        temperature=0, max_tokens=12, structured_outputs={"regex": "[0-9]{1,12}"}), use_tqdm=False)[0]
    assert out.text.isdigit()
    assert any(not tok.decode([t]).strip().isdigit() for t in proposed)  # letters were proposed ...
    assert all(tok.decode([t]).strip().isdigit() for t in verified)      # ... and never verified


# ---------------------------------------------------------------------- exact under speculation
def _structures() -> list[dict]:
    tasks = [SCHEMA_TASKS[i] for i in (0, 1, 3, 8, 10, 16)]
    return ([{"json": t.schema} for t in tasks] + [{"json": SCHEMA}, {"json_object": True},
            {"regex": "[a-c]{2,4}-[0-9]{2}"}, {"choice": ["red", "green", "blue"]},
            {"grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+'}])


@pytest.mark.parametrize("drafter", ["none", "ngram", "layerskip", "draft-near", "eagle"])
def test_constrained_greedy_with_speculation_equals_without(drafter, target, near_draft, eagle_head):
    """Against no drafts at all (k = 0: no grammar-forced drafts either): forced drafts
    alone ("none"), and merged with each drafter's (a draft model's and an EAGLE head's
    proposals masked by the grammar as they are drafted)."""
    structures = _structures()
    prompts = ["a b a b a b", "def f(x):", "hello world hello world"]
    work = [(p, s) for s in structures for p in prompts]

    def run(settings, k=None):
        llm = LLM32(target, num_speculative_tokens=3, speculative_adaptive=False, **SMALL, **settings)
        params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=s, num_speculative_tokens=k)
                  for _, s in work]
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
        assert llm.engine.scheduler.num_constrained == 0  # every one counted out as it ended
        return [(o.token_ids, o.finish_reason) for o in outs], llm.engine

    settings = drafters(target, near_draft, eagle_head)
    plain, off = run(settings["none"], k=0)
    assert off.forced_draft_stats.num_draft_tokens == 0
    drafted, engine = run(settings[drafter])
    assert drafted == plain
    assert engine.forced_draft_stats.num_accepted_tokens > 0  # the grammar's own drafts
    assert drafter == "none" or engine.spec_stats.num_draft_tokens > 0
    finished = [out for out, (_, s) in zip(plain, work) if "json" in s and out[1] == "stop"]
    assert finished  # some JSON completed within 48 tokens


def test_constrained_outputs_follow_their_structure(target):
    """Whatever the (random) model prefers, every output that ended on its own follows its
    structure: the JSON parses and validates, the regex and the choice match."""
    import re

    llm = LLM32(target, speculative_method="ngram", **SMALL)
    structures = _structures()
    prompts = ["a b a b", "x y z"]
    for temperature in (0.0, 0.8):
        work = [(p, s) for s in structures for p in prompts]
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, structured_outputs=s)
                  for i, (_, s) in enumerate(work)]
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        for out, (_, s) in zip(outs, work):
            if out.finish_reason != "stop":
                continue
            text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if "json" in s:
                jsonschema.validate(json.loads(text), s["json"])
            elif "json_object" in s:
                assert isinstance(json.loads(text), dict)
            elif "regex" in s:
                assert re.fullmatch(s["regex"], text.replace(" ", "")), text
            elif "choice" in s:
                assert text in s["choice"]
        assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2


# ---------------------------------------------------------------------- the distribution
GRAMMAR = {"regex": "[ab]{2}abab[ab]{2}"}  # its middle is forced: drafts of the grammar's own
PROMPT = "abababab"
NUM_DRAWS = 4000
PROMPT_IDS: list[int] = []
EOS: set[int] = set()


def exact_distribution(target: str, grammars) -> dict[tuple[int, ...], float]:
    """The target's distribution of whole outputs under the grammar at temperature 0.9:
    every prefix's next-token distribution with the grammar's mask applied (llguidance's
    matcher, copied at each branch), walked to the end-of-sequence token."""
    from llguidance.torch import fill_next_token_bitmask
    from transformers import AutoModelForCausalLM

    from specserve.structured import apply_masks

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    out: dict[tuple[int, ...], float] = {}

    def walk(matcher, prefix: list[int], output: list[int], prob: float) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([prefix + output])).logits[0, -1:].float()
        mask = torch.zeros((1, (logits.shape[1] + 31) // 32), dtype=torch.int32)
        fill_next_token_bitmask(matcher, mask, 0)
        apply_masks(logits, mask, [0])
        p = torch.softmax(logits[0] / 0.9, dim=-1)
        for token in p.nonzero()[:, 0].tolist():
            if matcher.deep_copy().consume_token(token) and token not in EOS:
                child = matcher.deep_copy()
                child.consume_token(token)
                walk(child, prefix, output + [token], prob * p[token].item())
            else:  # the end of the output
                out[tuple(output + [token])] = prob * p[token].item()

    walk(grammars.compile(StructuredOutputs(**GRAMMAR)).deep_copy(), PROMPT_IDS, [], 1.0)
    return out


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft-near"])
def test_constrained_sampling_with_drafts_has_the_target_distribution(drafter, target, near_draft):
    """4,000 seeded requests under the grammar [ab]{2}abab[ab]{2} with k = 2 (forced drafts
    alone with "none"), against the exact distribution of the target restricted to the
    grammar: chi-square p > 0.001."""
    llm = LLM32(target, num_speculative_tokens=2, speculative_adaptive=False, max_num_seqs=64,
                max_num_batched_tokens=256, block_size=4, num_kv_blocks=1200, **drafters(target, near_draft)[drafter])
    global PROMPT_IDS, EOS
    PROMPT_IDS, EOS = llm.tokenizer.encode(PROMPT), set(llm.engine.eos_token_ids)
    exact = exact_distribution(target, llm.engine.grammars)
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=12, structured_outputs=GRAMMAR)
              for s in range(NUM_DRAWS)]
    outs = llm.generate([PROMPT] * NUM_DRAWS, params, use_tqdm=False)
    assert llm.engine.forced_draft_stats.num_accepted_tokens > 0
    assert drafter == "none" or llm.engine.spec_stats.num_accepted_tokens > 0
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert chi_square_p(counts, exact) > 1e-3, counts.most_common(8)


def test_a_draft_pass_is_masked_along_its_own_proposals():
    """A draft model's rows with a grammar are masked as the target's are: step j by the
    grammar after the row's own first j proposals, on a copy of its matcher (the request's
    stays put); rows without one are untouched; a row the mask would empty keeps its logits."""
    from specserve.logits_process import LogitsProcess
    from specserve.structured import Grammars
    from tiny_models import make_tokenizer

    tokenizer = make_tokenizer(512)
    grammars = Grammars(tokenizer, 512, [2])
    spec = StructuredOutputs(choice=["def heapify", "def heappush", "class Random"])
    constraint = grammars.constraint(spec)
    from specserve.logits_process import RowHistory

    greedy, constrained = SamplingParams(temperature=0), SamplingParams(temperature=0, structured_outputs=spec)
    history = RowHistory(constrained, (), 0, 0)  # a request with a grammar has a history (processes_logits)
    process = LogitsProcess.for_drafting([history, None], [constrained, greedy], 512, torch.device("cpu"),
                                         [constraint, None])
    logits = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    proposals = []
    for _ in range(4):
        out = process.apply(logits)
        assert torch.equal(out[1], logits[1])
        token = int(out[0].argmax())
        fresh = grammars.constraint(spec)  # the grammar after the proposals so far
        fresh.accept(proposals)
        _, expected = fresh.check_drafts([])
        assert all(allows(expected[0], t) == bool(out[0, t] > float("-inf")) for t in range(512))
        proposals.append(token)
        process.advance(torch.tensor([token, 7]))
    assert any(c.startswith(tokenizer.decode(proposals, skip_special_tokens=True)) for c in spec.choice)
    _, masks = constraint.check_drafts([])  # the request's own matcher has not moved
    _, start = grammars.constraint(spec).check_drafts([])
    assert torch.equal(masks, start)
    # A draft vocabulary the grammar does not meet: the row keeps its logits (its proposal is cut later).
    empty = torch.full((1, 512), float("-inf"))
    empty[0, 3] = 1.0
    process = LogitsProcess.for_drafting([history], [constrained], 512, torch.device("cpu"),
                                         [grammars.constraint(spec)])
    assert torch.equal(process.apply(empty), empty)


# ---------------------------------------------------------------------- the default model
# Every pattern is bounded, and max_tokens below covers its longest match one character a
# token: at temperature 0.8 the default model, pushed by the mask, can write letters for as
# long as a pattern allows ("a martajudul..."), and which sample it draws moves with the
# adaptive draft lengths, which follow measured step times.
REGEX_TASKS = [
    ("What is a US phone number for a bakery?", r"\(\d{3}\) \d{3}-\d{4}"),
    ("When did the first person walk on the moon? Give the date.", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("Make up an email address for a florist.", r"[a-z]{3,12}@[a-z]{3,10}\.(com|org|net)"),
    ("Give an IPv4 address on a home network.", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
    ("A colour for a sunset, as a hex code:", r"#[0-9a-fA-F]{6}"),
    ("Name a fruit, in lower case.", r"[a-z]{2,12}( [a-z]{2,12})?"),
    ("How long does an egg boil? Answer like '7 minutes'.", r"[1-9]\d? (minutes|seconds)"),
    ("Write a short sentence about cats that ends with a full stop.", r"[A-Z][a-z ,']{5,60}\."),
]
CHOICE_TASKS = [
    ("Is this review positive or negative? 'The food was cold and late.'", ["positive", "negative", "neutral"]),
    ("Is the sky blue on a clear day?", ["yes", "no"]),
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Which is a programming language?", ["Python", "Cobra snake", "Java island"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_default_model_outputs_validate_against_every_schema(default_model_path, drafter):
    """Every schema of ``json_schemas.py``, asked through its chat prompt, greedy and at
    temperature 0.8: 100 % of the outputs parse and validate (jsonschema), and every
    regex and choice output matches, with speculation off, n-gram and the built-in draft."""
    from specserve import LLM

    llm = LLM(None, **({} if drafter == "none" else {"speculative_method": drafter}))  # the embedded model
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t.prompt}], tokenize=False,
                                                 add_generation_prompt=True) for t in SCHEMA_TASKS]
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400,
                                 structured_outputs={"json": t.schema}) for i, t in enumerate(SCHEMA_TASKS)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for task, out in zip(SCHEMA_TASKS, outs):
            assert out.finish_reason == "stop", (task.name, out.text)
            jsonschema.validate(json.loads(out.text), task.schema)
        # Regexes and choices: every output matches in full.
        asks = [(q, {"regex": r}) for q, r in REGEX_TASKS] + [(q, {"choice": c}) for q, c in CHOICE_TASKS]
        ask_prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                         add_generation_prompt=True) for q, _ in asks]
        ask_params = [SamplingParams(temperature=temperature, seed=i, max_tokens=80, structured_outputs=spec)
                      for i, (_, spec) in enumerate(asks)]
        for (_, spec), out in zip(asks, llm.generate(ask_prompts, ask_params, use_tqdm=False)):
            assert out.finish_reason == "stop", (spec, out.text)
            assert re.fullmatch(spec["regex"], out.text) if "regex" in spec else out.text in spec["choice"], \
                (spec, out.text)
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    forced = llm.engine.forced_draft_stats  # the grammar's own drafts: the mask allows only them
    assert forced.num_draft_tokens > 0 and forced.num_accepted_tokens == forced.num_draft_tokens
    llm.close()


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_token_bytes_are_read_from_the_vocabulary(kind):
    """llguidance gets each token's bytes read from the vocabulary (GPT-2's byte alphabet,
    or SentencePiece's "▁" and <0xAB>), not the tokenizer's serialised form, which
    transformers 5.17's GGUF conversion wrote so that llguidance misread most tokens of
    the default model. Every token reads as the tokenizer decodes it inside a text, and a
    grammar forces text tokenised as the tokenizer would."""
    from specserve.structured import Grammars, _token_text
    from tiny_models import make_sentencepiece_tokenizer, make_tokenizer

    tokenizer = make_tokenizer(512) if kind == "byte_level" else make_sentencepiece_tokenizer()
    grammars = Grammars(tokenizer, len(tokenizer), [2])
    text = _token_text(tokenizer)
    for token in range(3, len(tokenizer)):
        if "\ufffd" not in text(token):
            assert grammars._tokenizer.decode_bytes([token]) == text(token).encode(), token
    forced = grammars.constraint(StructuredOutputs(regex="def heapify x")).forced(20)
    assert tokenizer.decode(forced) == "def heapify x"
    if kind == "sentencepiece":  # a character the vocabulary cannot spell: its bytes
        assert tokenizer.decode(grammars.constraint(StructuredOutputs(regex="日本")).forced(20)) == "日本"


def test_a_tokenizer_read_wrongly_is_refused(monkeypatch):
    """Should the bytes read for the tokens differ from what the tokenizer decodes, masks
    would allow the wrong tokens: structured output is refused instead."""
    from specserve import structured
    from tiny_models import make_tokenizer

    read = structured._read_pieces

    def swapped(*args):
        tokens = read(*args)
        tokens[300], tokens[301] = tokens[301], tokens[300]
        return tokens

    monkeypatch.setattr(structured, "_read_pieces", swapped)
    with pytest.raises(ValueError, match="not available with this tokenizer"):
        structured.Grammars(make_tokenizer(512), 512, [2])


def test_a_request_that_leaves_its_grammar_ends_with_an_error_and_the_engine_goes_on(target, monkeypatch):
    """Should a token its mask allowed be refused (a library's fault), that request ends
    with an error; the others finish, and no block leaks."""
    from specserve.structured import Constraint

    llm = LLM32(target, **SMALL)
    accept = Constraint.accept

    def refuse_digits(self, tokens):
        if any(llm.tokenizer.decode([t]).strip().isdigit() for t in tokens):
            raise RuntimeError("refused")
        accept(self, tokens)

    monkeypatch.setattr(Constraint, "accept", refuse_digits)
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[0-9]{4}"}),
                                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "refused" in outs[0].error
    assert outs[1].finish_reason == "length"
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert llm.engine.scheduler.num_constrained == 0
