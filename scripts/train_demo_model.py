#!/usr/bin/env python3
"""Train ColiStream's built-in demo model (``coli/demo/model/``) from scratch on the CPU.

The demo model is a tiny but complete ``glm_moe_dsa`` (GLM-5 architecture: MLA attention with the DSA
lightning indexer, one dense layer, then MoE layers with sigmoid routing, a correction bias and a shared
expert) with a byte-level BPE tokenizer and a GLM-style chat template.

Pipeline (every step is seeded, so one ``--seed`` gives the same files on the same Python / torch build):

1. Corpus. The docstrings of the Python standard library of the running interpreter, gathered offline:
   ``.py`` files are parsed with ``ast`` (nothing is imported, so no import side effects), and the
   C-implemented modules (``builtins``, ``math``, ``itertools``, ...) are introspected with
   ``inspect.getdoc``. Docstrings are cleaned to plain English paragraphs (doctests, code blocks,
   parameter tables, reST markup and signature lines are dropped). Chat examples are synthesised from
   the same docstrings ("What does os.path.join do?" -> its docstring summary), plus a handful of
   greeting / identity turns, so that the chat template's turn structure is learned.
2. Tokenizer. Byte-level BPE (``tokenizers``: ByteLevel pre-tokenizer and decoder) with the GLM special
   tokens appended after the learned vocabulary, as in GLM's own vocabulary.
3. Model. ``GlmMoeDsaConfig`` with tiny sizes; every dimension a multiple of 64 where the container's
   group quantisation needs it. Trained with a plain AdamW loop (causal LM loss, cosine LR), all weights
   trainable, router included. Two things transformers' forward does not train are trained here the way
   DeepSeek-V3/V3.2 train them:
   * the router's ``e_score_correction_bias`` (a buffer) gets the auxiliary-loss-free load-balancing
     update after every step (``bias += rate * sign(mean_load - load)``);
   * the DSA indexer (run under ``no_grad`` by transformers) is trained with a KL loss towards the
     main attention's distribution (summed over heads), on detached inputs, so that it selects the
     keys attention actually uses once a context is longer than ``index_topk``.
   While training, sequences are never longer than ``index_topk``, so the indexer's top-k selects every
   key; the script skips that no-op selection (the result is identical) and restores it afterwards.
4. Output. ``save_pretrained`` files, ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
   template) and ``training.json`` (figures and a greedy sample) in ``--out``.

5. MTP head (``--mtp-head``, run after 1-4): GLM-5's draft layer (reference glm5.md §4, DeepSeek-V3 layout:
   ``eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])`` -> one decoder layer with MoE and a full indexer ->
   ``shared_head.norm`` -> the shared lm_head) trained on top of the **frozen** main model saved in ``--out``
   (its files are not rewritten: the main weights stay byte-identical). The MTP layer's decoder is transformers'
   own GlmMoeDsaDecoderLayer (a one-layer model whose final norm plays shared_head.norm), warm-started from
   the main model's last layer; loss (``--mtp-target teacher``, the default): distillation, the KL to the main
   model's own distribution one position ahead, on the same corpus and targets and (``--mtp-self-share``) on the main
   model's greedy continuations of training-split chat prompts, with chained drafts 2..3 (``--mtp-chain``);
   ``--mtp-target corpus`` is the first head's cross-entropy of the corpus token two ahead.
   Written to ``model-mtp.safetensors`` (layer index = num_hidden_layers, per-expert names) with a
   ``model.safetensors.index.json`` over both files; figures (held-out loss, first-draft acceptance against
   the main model's greedy choice, seconds) go to ``training-mtp.json``.

Usage (the command that produced the shipped model is recorded in coli/demo/README.md):

    .venv/bin/python scripts/train_demo_model.py --seed 0
    .venv/bin/python scripts/train_demo_model.py --seed 0 --mtp-head
"""

from __future__ import annotations

import os

# Single-threaded and deterministic: the machine is shared, and the BPE trainer must not depend on threads.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import ast
import contextlib
import importlib
import inspect
import json
import math
import platform
import random
import re
import sys
import sysconfig
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "coli" / "demo" / "model"

# --------------------------------------------------------------------------------------------------
# Special tokens and the chat template
# --------------------------------------------------------------------------------------------------

EOT, GMASK, SOP = "<|endoftext|>", "[gMASK]", "<sop>"
SYSTEM, USER, ASSISTANT, OBSERVATION, PAD = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|pad|>"
# Same relative order as GLM's vocabulary; they are appended after the learned BPE vocabulary.
SPECIAL_TOKENS = [EOT, GMASK, SOP, SYSTEM, USER, ASSISTANT, OBSERVATION, PAD]
# GLM-5 stops on <|endoftext|>, <|user|> and <|observation|> (reference glm5.md §1).
EOS_TOKENS = [EOT, USER, OBSERVATION]

# GLM style: "[gMASK]<sop>" once, then "<|role|>\n{content}" per message (a "tool" message is an
# observation), and "<|assistant|>\n" as the generation prompt. No separators between turns: the
# next role token ends the previous turn, which is why <|user|> is an end-of-sequence token.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% set role = 'observation' if message['role'] == 'tool' else message['role'] %}"
    "<|{{ role }}|>\n{{ message['content'] if message['content'] is not none else '' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


_TEMPLATE = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    return _TEMPLATE.render(messages=messages, add_generation_prompt=add_generation_prompt)


# --------------------------------------------------------------------------------------------------
# Corpus: stdlib docstrings
# --------------------------------------------------------------------------------------------------

# Directories of the stdlib that are tests, GUIs, demos, vendored or generated data rather than API docs.
SKIP_DIRS = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
    "dist-packages", "__pycache__", "pydoc_data", "encodings", "venv", "lib-dynload",
}
SKIP_FILES = {"turtle.py", "this.py", "antigravity.py", "__phello__.foo.py"}
# C modules that are test helpers, GUIs/terminals or platform oddities.
SKIP_C_MODULES = re.compile(r"^(_test|xx|_xx|_tkinter|_curses|readline|_ctypes_test|nis|spwd|ossaudiodev|_crypt)")
# os.path is posixpath (plus genericpath) on this platform; ask about it under the name people use.
MODULE_ALIASES = {"posixpath": "os.path", "genericpath": "os.path", "posix": "os", "builtins": ""}

SIGNATURE_LINE = re.compile(r"^\s*[\w.\[\]]+\(.*\)\s*(->.*)?$")
RULE_LINE = re.compile(r"^\s*([-=~^*#+_.])\1{2,}\s*$")
LISTY_LINE = re.compile(r"^\s*([-*+]\s|\d+[.)]\s|[\w*.,\[\] ]+ --? |[\w*]+ ?: )")


@dataclass
class Doc:
    module: str          # public module name ("" for builtins)
    name: str            # public dotted name ("os.path.join", "str.join", "json") or "" if private
    kind: str            # "module", "class", "function"
    paragraphs: list[str]
    summary: str | None = None   # for chat answers; taken before paragraphs are deduplicated


def _clean_markup(text: str) -> str:
    text = re.sub(r"<?\bhttps?://[^\s>]+>?", "", text)        # URLs (the sentence around them is kept)
    text = re.sub(r":[\w:+-]+:`~?([^`]*)`", r"\1", text)      # :func:`x` -> x
    text = re.sub(r"``([^`]*)``", r"\1", text)               # ``x`` -> x
    text = re.sub(r"`([^`']*)'", r"'\1'", text)              # old style `x' -> 'x'
    text = re.sub(r"`([^`]*)`", r"\1", text)                 # `x` -> x
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"\*([A-Za-z_][\w ]*)\*", r"\1", text)     # *name* -> name
    text = re.sub(r"\s+", " ", text).strip()
    return text


def clean_docstring(doc: str) -> list[str]:
    """Plain English paragraphs of one docstring; code, doctests, tables and lists are dropped."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", doc.expandtabs()):
        lines = [line for line in block.split("\n") if line.strip()]
        # Leading signature lines of C docstrings ("dict(mapping) -> new dictionary ...", "--").
        while lines and (SIGNATURE_LINE.match(lines[0]) or lines[0].strip() == "--"):
            lines.pop(0)
        if not lines:
            continue
        if lines[0][:1].isspace():                                  # indented: code or a nested list
            continue
        if any(line.lstrip().startswith((">>>", "...", "$ ", "%")) for line in lines):
            continue
        if any(RULE_LINE.match(line) for line in lines):            # reST headings and tables
            continue
        if len(lines) > 1 and (any(line[:1].isspace() for line in lines[1:])
                               or sum(bool(LISTY_LINE.match(line)) for line in lines) >= 2):
            continue                                                # parameter lists, bullet lists
        if lines[-1].rstrip().endswith("::"):                       # introduces a code block
            continue
        text = _clean_markup(" ".join(line.strip() for line in lines))
        if not _is_prose(text):
            continue
        if text[-1].isalnum() or text[-1] in ")'\"":
            text += "."
        paragraphs.append(text)
    return paragraphs


def _is_prose(text: str) -> bool:
    if not text.isascii() or len(text) < 12 or len(text) > 1500:
        return False
    if not text[0].isalpha():
        return False
    words = text.split()
    if len(words) < 3 or sum(bool(re.fullmatch(r"[a-z]{3,}[,.;:]?", w)) for w in words) < 2:
        return False
    plain = sum(c.isalpha() or c in " ,.;:'()-?!\"" for c in text)
    if plain / len(text) < 0.9:
        return False
    lowered = text.lower()
    banned = ("://", "copyright", "xxx", "todo", "fixme", "all rights reserved", "license", "author:")
    return not any(b in lowered for b in banned)


def summary_of(paragraphs: list[str], max_chars: int = 300) -> str | None:
    """First sentence of the first paragraph (two when the first is short)."""
    if not paragraphs:
        return None
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraphs[0])
    out = sentences[0][:1].upper() + sentences[0][1:]
    if len(out) < 60 and len(sentences) > 1 and len(out) + len(sentences[1]) < max_chars:
        out += " " + sentences[1]
    if len(out) > max_chars or len(out.split()) < 3:
        return None
    return out


def _public(module: str) -> bool:
    return all(not part.startswith("_") for part in module.split(".") if part)


def _public_module_name(module: str, known: set[str]) -> str | None:
    """Name under which users import `module`, or None when it is private."""
    if module in MODULE_ALIASES:
        return MODULE_ALIASES[module]
    if _public(module):
        return module
    if module.startswith("_") and module[1:] in known:        # _collections -> collections
        return module[1:]
    return None


def stdlib_py_files(stdlib: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("config-", "lib-")))
        for f in sorted(filenames):
            if f.endswith(".py") and not f.startswith("test_") and f not in SKIP_FILES:
                files.append(Path(dirpath) / f)
    return files


def _module_name(path: Path, stdlib: Path) -> str:
    parts = list(path.relative_to(stdlib).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def gather_py_docs(stdlib: Path, known: set[str]) -> list[Doc]:
    """Docstrings of the stdlib's .py files, in source order, read with ast (nothing is imported)."""
    docs = []
    for path in stdlib_py_files(stdlib):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = _module_name(path, stdlib)
        public_mod = _public_module_name(module, known)

        def visit(node, prefix: str, private: bool):
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if child.name.startswith("__") and child.name.endswith("__"):
                    continue                                        # dunder docs are boilerplate
                is_private = private or child.name.startswith("_")
                doc = ast.get_docstring(child)
                if doc:
                    qual = f"{prefix}.{child.name}" if prefix else child.name
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    name = "" if (is_private or public_mod is None) else qual
                    docs.append(Doc(public_mod or module, name, kind, clean_docstring(doc)))
                if isinstance(child, ast.ClassDef):                 # methods, nested classes
                    visit(child, f"{prefix}.{child.name}" if prefix else child.name, is_private)

        doc = ast.get_docstring(tree)
        if doc:
            docs.append(Doc(public_mod or module, public_mod or "", "module", clean_docstring(doc)))
        visit(tree, public_mod if public_mod is not None else module, public_mod is None)
    return docs


def c_module_names(stdlib: Path) -> list[str]:
    names = set(sys.builtin_module_names)
    dynload = stdlib / "lib-dynload"
    if dynload.is_dir():
        names.update(p.name.split(".")[0] for p in dynload.iterdir() if p.name.endswith(".so"))
    return sorted(n for n in names if not SKIP_C_MODULES.match(n))


def gather_c_docs(stdlib: Path, known: set[str]) -> list[Doc]:
    """Docstrings of C-implemented modules, their functions, classes and methods (inspect.getdoc)."""
    docs = []
    for modname in c_module_names(stdlib):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(modname)
        except Exception:
            continue
        public_mod = _public_module_name(modname, known)
        prefix = public_mod if public_mod is not None else modname
        if mod.__doc__:
            docs.append(Doc(public_mod or modname, public_mod or "", "module",
                            clean_docstring(inspect.cleandoc(mod.__doc__))))
        for attr in sorted(vars(mod)):
            obj = vars(mod)[attr]
            if not (inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if inspect.isclass(obj) and obj.__module__ not in (modname, prefix):
                continue                                            # re-exported from elsewhere
            private = attr.startswith("_") or public_mod is None
            qual = f"{prefix}.{attr}" if prefix else attr
            own = obj.__doc__ if inspect.isclass(obj) else inspect.getdoc(obj)
            if isinstance(own, str) and own:
                kind = "class" if inspect.isclass(obj) else "function"
                docs.append(Doc(public_mod or modname, "" if private else qual, kind,
                                clean_docstring(inspect.cleandoc(own))))
            if inspect.isclass(obj):
                for mname in sorted(vars(obj)):
                    meth = vars(obj)[mname]
                    mdoc = getattr(meth, "__doc__", None)
                    if not callable(meth) and not inspect.ismethoddescriptor(meth):
                        continue
                    if not isinstance(mdoc, str) or mname.startswith("__"):
                        continue
                    mprivate = private or mname.startswith("_")
                    docs.append(Doc(public_mod or modname, "" if mprivate else f"{qual}.{mname}", "function",
                                    clean_docstring(inspect.cleandoc(mdoc))))
    return docs


def gather_corpus(heldout_every: int) -> tuple[dict[str, list[Doc]], dict[str, list[Doc]], dict]:
    """Docs grouped by module, split into train / held-out by a hash of the module name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    known = {_module_name(p, stdlib) for p in stdlib_py_files(stdlib)} | set(c_module_names(stdlib))
    docs = gather_py_docs(stdlib, known) + gather_c_docs(stdlib, known)
    seen: set[str] = set()
    by_module: dict[str, list[Doc]] = {}
    for d in docs:
        summary = summary_of(d.paragraphs) if d.name else None
        paras = [p for p in d.paragraphs if not (p in seen or seen.add(p))]   # dedupe, keep first
        if paras or summary:
            by_module.setdefault(d.module, []).append(Doc(d.module, d.name, d.kind, paras, summary))
    train, heldout = {}, {}
    for module in sorted(by_module):
        key = module.split(".")[0] or "builtins"
        target = heldout if zlib.crc32(key.encode()) % heldout_every == 0 else train
        target[module] = by_module[module]
    stats = {"stdlib": str(stdlib), "python": platform.python_version(), "docstrings": len(docs),
             "modules_train": len(train), "modules_heldout": sorted(heldout)}
    return train, heldout, stats


# --------------------------------------------------------------------------------------------------
# Chat examples
# --------------------------------------------------------------------------------------------------

FUNCTION_QUESTIONS = ["What does {n} do?", "What does {n} do?", "What is {n} for?", "Explain {n}.",
                      "Can you describe {n}?", "What is the purpose of {n}?", "Tell me about {n}.", "{n}?"]
CLASS_QUESTIONS = ["What is {n}?", "What is the {n} class?", "Describe the class {n}.", "Tell me about {n}.",
                   "What is {n} used for?"]
MODULE_QUESTIONS = ["Tell me about the {n} module.", "What is the {n} module for?", "What does the {n} module do?",
                    "Describe the {n} module.", "What is {n}?"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a tiny demo model that answers questions about Python.",
                  "Answer briefly."]
SMALL_TALK = [
    (["Hello", "Hi", "Hi there!", "Hello!", "Good morning.", "Hey"],
     ["Hello! I am a tiny demo model trained on Python documentation. Ask me what a Python module or function does.",
      "Hi! Ask me about a Python module or function, for example: What does os.path.join do?"]),
    (["Who are you?", "What are you?", "What can you do?", "Introduce yourself."],
     ["I am the ColiStream demo model, a tiny glm_moe_dsa language model trained for a few minutes on the "
      "docstrings of the Python standard library. I can answer simple questions about Python modules and "
      "functions, but my answers are often wrong."]),
    (["Thank you", "Thanks!", "Thanks, that helps."],
     ["You are welcome.", "You are welcome! Ask me about another Python function if you like."]),
    (["Bye", "Goodbye!"], ["Goodbye!"]),
]


# Imperative verbs that start docstring summaries ("Return the ...", "Join two ..."); an answer turns them
# into "It joins two ...", which reads as a reply. (Restating the full name instead, "os.path.join joins ...",
# needs the model to copy from the question, which a few minutes of training does not teach: it then
# writes a wrong name.)
IMPERATIVES = set("""
Accept Acquire Add Append Apply Arrange Assert Bind Build Calculate Call Cancel Change Check Clear Close Compare
Compile Compress Compute Configure Connect Construct Convert Copy Count Create Decode Decompress Delegate Delete
Determine Disable Discard Display Do Dump Emit Enable Encode Ensure Escape Execute Expand Extract Fail Feed Fetch
Fill Find Finish Flush Format Generate Get Guess Handle Hash Indent Indicate Initialize Insert Install Invoke
Iterate Join Load Log Look Make Mark Match Move Normalize Open Override Pack Parse Partition Perform Pop Prepare
Print Process Produce Push Put Quote Read Receive Register Release Remove Rename Replace Report Request Reset
Resolve Retrieve Return Reverse Round Run Save Scan Schedule Search Seek Send Serialize Set Show Sign Skip Sort
Split Start Stop Store Strip Submit Sum Take Tell Test Translate Truncate Try Turn Unpack Unquote Unregister
Update Use Validate Verify Wait Wake Walk Wrap Write Yield
""".split())


def third_person(verb: str) -> str:
    v = verb.lower()
    if v.endswith(("s", "sh", "ch", "x", "z", "o")):
        return v + "es"
    if v.endswith("y") and v[-2:-1] not in ("a", "e", "i", "o", "u"):
        return v[:-1] + "ies"
    return v + "s"


def answer_for(kind: str, name: str, summary: str) -> str:
    """The assistant's reply: the docstring summary, phrased as an answer about the thing asked about."""
    if kind == "module":
        return f"It is a module of the Python standard library. {summary}"
    if kind == "class":
        return f"It is a {'built-in ' if '.' not in name else ''}class. {summary}"
    first, _, rest = summary.partition(" ")
    if first in IMPERATIVES and rest:
        return f"It {third_person(first)} {rest}"
    if first.endswith("s") and (first[:-1] in IMPERATIVES or first[:-2] in IMPERATIVES) and rest:
        return f"It {first.lower()} {rest}"                          # "Returns ..." is already 3rd person
    return summary


def qa_pairs(modules: dict[str, list[Doc]]) -> list[tuple[str, str]]:
    pairs = []
    for module in sorted(modules):
        for d in modules[module]:
            if d.name and d.summary:
                pairs.append((d.kind, d.name, d.summary))
    return pairs


def make_chats(modules: dict[str, list[Doc]], rng: random.Random, small_talk_share: float) -> list[list[dict]]:
    """One chat per documented public name (sometimes with a system prompt or a second turn)."""
    pairs = qa_pairs(modules)
    rng.shuffle(pairs)

    def ask(kind, name, summary):
        questions = {"module": MODULE_QUESTIONS, "class": CLASS_QUESTIONS}.get(kind, FUNCTION_QUESTIONS)
        q = rng.choice(questions).format(n=name)
        return [{"role": "user", "content": q}, {"role": "assistant", "content": answer_for(kind, name, summary)}]

    chats = []
    i = 0
    while i < len(pairs):
        msgs = []
        if rng.random() < 0.25:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns = 1 if rng.random() < 0.75 else rng.choice([2, 3])
        for pair in pairs[i:i + turns]:
            msgs += ask(*pair)
        i += turns
        chats.append(msgs)
    n_small = int(len(chats) * small_talk_share)
    for _ in range(n_small):
        questions, answers = rng.choice(SMALL_TALK)
        msgs = [{"role": "user", "content": rng.choice(questions)},
                {"role": "assistant", "content": rng.choice(answers)}]
        if rng.random() < 0.5 and pairs:
            msgs += ask(*rng.choice(pairs))
        chats.append(msgs)
    rng.shuffle(chats)
    return chats


def module_texts(modules: dict[str, list[Doc]]) -> list[tuple[str, list[int]]]:
    """One text per module (its docstrings in source order) and the char offset where each docstring starts."""
    out = []
    for module in sorted(modules):
        parts, starts, pos = [], [], 0
        for d in modules[module]:
            if not d.paragraphs:
                continue
            piece = "\n\n".join(d.paragraphs)
            starts.append(pos)
            parts.append(piece)
            pos += len(piece) + 2
        out.append(("\n\n".join(parts), starts))
    return out


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)                   # ids vocab_size-8 .. vocab_size-1, as in GLM
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": GMASK,
        "eos_token": EOT,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": [SOP, SYSTEM, USER, ASSISTANT, OBSERVATION],
        "eos_tokens": EOS_TOKENS,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "padding_side": "left",
    }


# --------------------------------------------------------------------------------------------------
# Token streams and batches
# --------------------------------------------------------------------------------------------------

class Stream:
    """A concatenation of documents; rows start at document (docstring / chat) boundaries. `targets` marks the
    tokens that are trained as predictions (all of prose; in chats, the assistant's words and the token that
    ends its turn, not the prompts, which the template and the user supply)."""

    def __init__(self, ids: list[int], starts: list[int], targets: list[bool] | None = None):
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.targets = torch.ones(len(ids), dtype=torch.bool) if targets is None else torch.tensor(targets)
        self.starts = torch.tensor(sorted(set(starts)), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        valid = self.starts[self.starts + length <= len(self.ids)]
        pick = valid[torch.randint(len(valid), (n,), generator=gen)].tolist()
        return (torch.stack([self.ids[s:s + length] for s in pick]),
                torch.stack([self.targets[s:s + length] for s in pick]))


def encode_chat(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of render_chat(messages) + <|endoftext|>, and which of them are assistant output. Special
    tokens split the text, so encoding turn by turn gives exactly the ids of encoding the whole text."""
    roles = ["observation" if m["role"] == "tool" else m["role"] for m in messages]
    assert render_chat(messages) == GMASK + SOP + "".join(f"<|{r}|>\n{m['content']}" for r, m in zip(roles, messages))
    ids = tok.encode(GMASK + SOP).ids
    targets = [False] * len(ids)
    for r, m in zip(roles, messages):
        role = tok.encode(f"<|{r}|>").ids
        ids += role
        targets += [targets[-1]] * len(role)                 # the role token ends the previous turn
        body = tok.encode("\n" + m["content"]).ids
        ids += body
        targets += [m["role"] == "assistant"] * len(body)
    ids.append(tok.token_to_id(EOT))
    targets.append(True)
    return ids, targets


def build_streams(tok, modules, chats, rng: random.Random) -> tuple[Stream, Stream]:
    eot = tok.token_to_id(EOT)
    texts = module_texts(modules)
    rng.shuffle(texts)
    ids, starts = [], []
    for text, char_starts in texts:
        enc = tok.encode(text)
        offsets = [o[0] for o in enc.offsets]
        j = 0
        for c in char_starts:                                # token index of each docstring start
            while j < len(offsets) and offsets[j] < c:
                j += 1
            starts.append(len(ids) + j)
        ids += enc.ids + [eot]
    prose = Stream(ids, starts)
    ids, starts, targets = [], [], []
    for msgs in chats:
        starts.append(len(ids))
        i, t = encode_chat(tok, msgs)
        ids += i
        targets += t
    return prose, Stream(ids, starts, targets)


def sample_batch(prose: Stream, chat: Stream, rows: int, length: int, chat_share: float, gen: torch.Generator):
    """`rows` sequences of length+1 tokens and their target masks; each row is chat with p = chat_share."""
    n_chat = int(torch.binomial(torch.tensor(float(rows)), torch.tensor(chat_share), generator=gen).item())
    parts = []
    if rows - n_chat:
        parts.append(prose.rows(rows - n_chat, length + 1, gen))
    if n_chat:
        parts.append(chat.rows(n_chat, length + 1, gen))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------

def build_config(args, tok):
    from transformers import GlmMoeDsaConfig

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return GlmMoeDsaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        first_k_dense_replace=1,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=args.index_heads,
        index_head_dim=32,
        index_topk=args.index_topk,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=ids[GMASK],
        eos_token_id=[ids[t] for t in EOS_TOKENS],
        pad_token_id=ids[PAD],
        dtype="float32",
    )


@contextlib.contextmanager
def dense_indexer_shortcut():
    """While a sequence is no longer than index_topk (and there is no cache), the DSA top-k keeps every key,
    so the selection is a no-op: return all indices without scoring. Exactly the same attention."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    original = m.GlmMoeDsaIndexer.forward

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                past_key_values=None):
        bsz, seq, _ = hidden_states.shape
        if past_key_values is None and seq <= self.index_topk:
            return torch.arange(seq, dtype=torch.int32).expand(bsz, seq, seq)
        return original(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                        past_key_values=past_key_values)

    m.GlmMoeDsaIndexer.forward = forward
    try:
        yield
    finally:
        m.GlmMoeDsaIndexer.forward = original


def indexer_scores(idx, x, q_resid, cos, sin):
    """The indexer's index scores [B, S, T] before masking, with gradients (same math as its forward)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    bsz, seq, _ = x.shape
    q = idx.wq_b(q_resid).view(bsz, seq, idx.n_heads, idx.head_dim)
    q_rot, q_pass = torch.split(q, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    k = idx.k_norm(idx.wk(x)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * idx.softmax_scale)
    weights = idx.weights_proj(x).float() * (idx.n_heads ** -0.5)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def indexer_kl_loss(attn, x, cos, sin) -> torch.Tensor:
    """KL(attention distribution summed over heads || softmax(index scores)), as in DeepSeek-V3.2's
    indexer warm-up. Inputs are detached: only the indexer learns from this loss."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    bsz, seq, _ = x.shape
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_resid).view(bsz, seq, -1, attn.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        k_pass = attn.kv_a_layernorm(kv_pass).view(bsz, 1, seq, attn.kv_lora_rank)
        k_rot = k_rot.view(bsz, 1, seq, attn.qk_rope_head_dim)
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        keys, _ = attn.expand_kv(k_pass, k_rot)
        logits = torch.cat([q_pass, q_rot], dim=-1) @ keys.transpose(-1, -2) * attn.scaling
        probs = logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)       # [B, S, T]
        target = probs / probs.sum(-1, keepdim=True)
    scores = indexer_scores(attn.indexer, x, q_resid, cos, sin).masked_fill(~causal, -1e9)
    logq = scores.log_softmax(-1)
    return (torch.xlogy(target, target) - target * logq).sum(-1).mean()


class RouterTap:
    """Counts expert selections per MoE layer (for the load-balancing bias update and for statistics)."""

    def __init__(self, model):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, GlmMoeDsaTopkRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        self.enabled = True
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            if self.enabled:
                self.counts[i] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()
        return hook

    def reset(self):
        for c in self.counts:
            c.zero_()

    @torch.no_grad()
    def balance(self, rate: float):
        for r, c in zip(self.routers, self.counts):
            r.e_score_correction_bias += rate * torch.sign(c.mean() - c)

    def imbalance(self) -> list[float]:
        return [round((c.max() / c.mean()).item(), 2) if c.sum() else 0.0 for c in self.counts]


class AttentionTap:
    """Keeps the (detached) inputs of every attention layer for the first rows of a batch."""

    def __init__(self, model, rows: int):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

        self.layers = [m for m in model.modules() if isinstance(m, GlmMoeDsaAttention)]
        self.rows = rows
        self.enabled = False
        self.saved: list[tuple] = []
        for attn in self.layers:
            attn.register_forward_pre_hook(self._hook(attn), with_kwargs=True)

    def _hook(self, attn):
        def hook(module, args, kwargs):
            if self.enabled and self.rows:
                x = kwargs["hidden_states"][: self.rows].detach()
                cos, sin = kwargs["position_embeddings"]
                self.saved.append((attn, x, cos[: self.rows].detach(), sin[: self.rows].detach()))
        return hook

    def loss(self) -> torch.Tensor | None:
        if not self.saved:
            return None
        losses = [indexer_kl_loss(attn, x, cos, sin) for attn, x, cos, sin in self.saved]
        self.saved = []
        return torch.stack(losses).mean()


def lm_loss(model, batch: torch.Tensor, targets: torch.Tensor, reduce: bool = True):
    """Causal LM cross-entropy over the target tokens (mean, or (sum, count) with reduce=False)."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="none")
    mask = targets[:, 1:].reshape(-1).float()
    if reduce:
        return (ce * mask).sum() / mask.sum().clamp(min=1)
    return (ce * mask).sum(), mask.sum()


@torch.no_grad()
def evaluate(model, rows: tuple[torch.Tensor, torch.Tensor], chunk: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0.0
    for i in range(0, len(rows[0]), chunk):
        s, n = lm_loss(model, rows[0][i:i + chunk], rows[1][i:i + chunk], reduce=False)
        total, count = total + s.item(), count + n.item()
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor * peak + (1 - floor) * peak * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def greedy_reply(model, tok, messages: list[dict], max_new_tokens: int) -> dict:
    prompt = render_chat(messages, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt).ids])
    eos = [tok.token_to_id(t) for t in EOS_TOKENS]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=tok.token_to_id(PAD))
    new = out[0, ids.shape[1]:].tolist()
    text = tok.decode([t for t in new if t not in eos], skip_special_tokens=False)
    return {"messages": messages, "prompt": prompt, "prompt_ids": ids[0].tolist(), "output_ids": new,
            "stopped_on": tok.id_to_token(new[-1]) if new and new[-1] in eos else None, "reply": text}


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (replaced files only)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    g = p.add_argument_group("data")
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--chat-share", type=float, default=0.5, help="share of training rows drawn from chat examples")
    g.add_argument("--small-talk-share", type=float, default=0.05,
                   help="greeting / identity chats, as a share of the docstring chats")
    g.add_argument("--heldout-every", type=int, default=20,
                   help="hold out top-level modules whose crc32 %% N == 0")
    g.add_argument("--heldout-rows", type=int, default=48)
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=192)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--intermediate", type=int, default=384, help="dense MLP width (layer 0)")
    g.add_argument("--moe-intermediate", type=int, default=64)
    g.add_argument("--experts", type=int, default=16)
    g.add_argument("--top-k", type=int, default=4)
    g.add_argument("--index-heads", type=int, default=16)
    g.add_argument("--index-topk", type=int, default=256)
    g.add_argument("--max-positions", type=int, default=4096)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=600)
    g.add_argument("--batch-tokens", type=int, default=1024, help="tokens per step (rows x sequence length)")
    g.add_argument("--seq-len", type=int, default=256, help="sequence length of the last steps")
    g.add_argument("--short-seq-len", type=int, default=128, help="sequence length of the first steps")
    g.add_argument("--short-frac", type=float, default=0.7, help="share of steps at --short-seq-len")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr-frac", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--bias-update-rate", type=float, default=1e-2,
                   help="aux-loss-free balancing step for e_score_correction_bias (0 disables)")
    g.add_argument("--indexer-kl-rows", type=int, default=1,
                   help="rows per batch on which the DSA indexer is trained (0 disables)")
    g.add_argument("--log-every", type=int, default=20)
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--sample-tokens", type=int, default=40)
    g = p.add_argument_group("MTP head (--mtp-head: train only the draft layer on the frozen model in --out)")
    g.add_argument("--mtp-head", action="store_true")
    g.add_argument("--mtp-steps", type=int, default=1000)
    g.add_argument("--mtp-lr", type=float, default=2e-3)
    g.add_argument("--mtp-target", choices=["corpus", "teacher"], default="teacher",
                   help="corpus: cross-entropy of the corpus token two ahead; teacher: distil the main model's own "
                        "distribution there (KL), what drafts are accepted on")
    g.add_argument("--mtp-temperature", type=float, default=1.0, help="distillation temperature (--mtp-target teacher)")
    g.add_argument("--mtp-self-share", type=float, default=0.5,
                   help="share of training rows from the main model's own greedy continuations of training-split chat "
                        "prompts (0: corpus rows only)")
    g.add_argument("--mtp-self-prompts", type=int, default=1024, help="prompts continued for --mtp-self-share")
    g.add_argument("--mtp-self-tokens", type=int, default=64, help="greedy tokens per continued prompt")
    g.add_argument("--mtp-chain", type=int, default=2, choices=[0, 1, 2],
                   help="also train chained drafts 2..N+1 (the layer's own output as h), as --mtp 2/3 decodes")
    g.add_argument("--mtp-chain-weight", type=float, default=0.5, help="weight of each chained draft's loss")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mtp_head:
        return train_mtp_head(args, argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    import transformers
    import tokenizers
    from transformers import GlmMoeDsaForCausalLM
    transformers.logging.set_verbosity_error()

    def log(msg: str):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # ---- corpus
    train_mods, heldout_mods, corpus_stats = gather_corpus(args.heldout_every)
    train_chats = make_chats(train_mods, rng, args.small_talk_share)
    heldout_chats = make_chats(heldout_mods, random.Random(args.seed + 1), 0.0)
    paragraphs = [p for docs in train_mods.values() for d in docs for p in d.paragraphs]
    log(f"corpus: {corpus_stats['docstrings']} docstrings, {len(paragraphs)} paragraphs "
        f"({sum(map(len, paragraphs)) / 1e6:.2f} M chars) in {len(train_mods)} modules; "
        f"{len(train_chats)} chats; held out: {', '.join(corpus_stats['modules_heldout'])}")

    # ---- tokenizer
    tok_texts = [t for t, _ in module_texts(train_mods)] + [render_chat(c) for c in train_chats]
    tok = train_tokenizer(tok_texts, args.vocab_size)
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    log(f"tokenizer: vocab {tok.get_vocab_size()}, special ids {special_ids}")

    prose, chat = build_streams(tok, train_mods, train_chats, rng)
    h_prose, h_chat = build_streams(tok, heldout_mods, heldout_chats, random.Random(args.seed + 2))
    heldout_rows = sample_batch(h_prose, h_chat, args.heldout_rows, args.seq_len, args.chat_share,
                                torch.Generator().manual_seed(args.seed + 3))
    corpus_tokens = {"prose": len(prose), "chat": len(chat), "chat_assistant": int(chat.targets.sum()),
                     "heldout_prose": len(h_prose), "heldout_chat": len(h_chat)}
    log(f"tokens: {corpus_tokens}")

    # ---- model
    config = build_config(args, tok)
    torch.manual_seed(args.seed)
    model = GlmMoeDsaForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.3f} M parameters ({n_params * 4 / 2**20:.1f} MiB fp32)")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    routers = RouterTap(model)
    attn_tap = AttentionTap(model, args.indexer_kl_rows)
    indexer_params = {id(p) for m in attn_tap.layers for p in m.indexer.parameters()}

    history = []
    short_steps = int(args.steps * args.short_frac)
    t_train = time.time()
    seen_tokens = trained_tokens = 0
    loss_avg = None
    with dense_indexer_shortcut():
        initial_eval = evaluate(model, heldout_rows)
        log(f"held-out loss at init {initial_eval:.3f}")
        for step in range(args.steps):
            seq = args.short_seq_len if step < short_steps else args.seq_len
            batch, targets = sample_batch(prose, chat, max(1, args.batch_tokens // seq), seq, args.chat_share, gen)
            lr = lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_frac)
            for group in opt.param_groups:
                group["lr"] = lr
            routers.reset()
            attn_tap.enabled = True
            loss = lm_loss(model, batch, targets)
            attn_tap.enabled = False
            kl = attn_tap.loss()
            total = loss + kl if kl is not None else loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if id(p) not in indexer_params], args.clip)
            torch.nn.utils.clip_grad_norm_([p for m in attn_tap.layers for p in m.indexer.parameters()], args.clip)
            opt.step()
            if args.bias_update_rate:
                routers.balance(args.bias_update_rate)
            seen_tokens += batch[:, 1:].numel()
            trained_tokens += int(targets[:, 1:].sum())
            loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
            if step % args.log_every == 0 or step == args.steps - 1:
                elapsed = time.time() - t_train
                rec = {"step": step, "loss": round(loss.item(), 4), "loss_ema": round(loss_avg, 4),
                       "indexer_kl": round(kl.item(), 4) if kl is not None else None, "lr": round(lr, 6),
                       "grad_norm": round(float(grad_norm), 3), "seq_len": seq, "tokens": seen_tokens,
                       "expert_load_max_over_mean": routers.imbalance(), "elapsed_s": round(elapsed, 1)}
                if step and (step % args.eval_every == 0 or step == args.steps - 1):
                    rec["heldout_loss"] = round(evaluate(model, heldout_rows), 4)
                history.append(rec)
                log(f"step {step:4d}  loss {loss.item():.3f} (ema {loss_avg:.3f})  kl {rec['indexer_kl']}  "
                    f"lr {lr:.2e}  |g| {float(grad_norm):.2f}  load {rec['expert_load_max_over_mean']}  "
                    f"{seen_tokens / elapsed:.0f} tok/s" + (f"  held-out {rec['heldout_loss']:.3f}"
                                                              if "heldout_loss" in rec else ""))
        train_seconds = time.time() - t_train
        final_heldout = history[-1].get("heldout_loss") or evaluate(model, heldout_rows)
    routers.enabled = False
    model.eval()

    # ---- sanity sample (real indexer path restored)
    # (question, module it is about): the first is the brief's check; mimetypes and fractions are held out.
    questions = [("What does os.path.join do?", "os.path"), ("What does str.split do?", ""),
                 ("Tell me about the json module.", "json"), ("What does mimetypes.guess_type do?", "mimetypes"),
                 ("What is fractions.Fraction?", "fractions"), ("Hello", None)]
    samples = []
    for q, module in questions:
        s = greedy_reply(model, tok, [{"role": "user", "content": q}], args.sample_tokens)
        s["about_heldout_module"] = module in heldout_mods
        samples.append(s)
        log(f"sample: {q!r} -> {s['reply']!r} (stop: {s['stopped_on']}, held out: {s['about_heldout_module']})")

    # ---- save
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "training.json"):
        (out / name).unlink(missing_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.max_positions), indent=2) + "\n")
    bias = {f"layer_{i + 1}": [round(v, 4) for v in r.e_score_correction_bias.tolist()]
            for i, r in enumerate(routers.routers)}
    record = {
        "command": "python scripts/train_demo_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "seed": args.seed,
        "corpus": {**corpus_stats, "paragraphs_train": len(paragraphs), "chats_train": len(train_chats),
                   "chats_heldout": len(heldout_chats), "tokens": corpus_tokens,
                   "corpus_tokens_train": corpus_tokens["prose"] + corpus_tokens["chat"]},
        "special_token_ids": special_ids,
        "eos_token_ids": [special_ids[t] for t in EOS_TOKENS],
        "parameters": n_params,
        "steps": args.steps,
        "tokens_seen": seen_tokens,
        "tokens_trained": trained_tokens,
        "initial_heldout_loss": round(initial_eval, 4),
        "final_train_loss": round(history[-1]["loss"], 4),
        "final_train_loss_ema": round(loss_avg, 4),
        "heldout_loss": round(final_heldout, 4),
        "final_indexer_kl": history[-1]["indexer_kl"],
        "final_expert_load_max_over_mean": history[-1]["expert_load_max_over_mean"],
        "e_score_correction_bias": bias,
        "train_wall_seconds": round(train_seconds, 1),
        "total_wall_seconds": round(time.time() - t_start, 1),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "samples": [{k: s[k] for k in ("messages", "prompt", "reply", "output_ids", "stopped_on",
                                       "about_heldout_module")} for s in samples],
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"saved to {out} ({size / 2**20:.1f} MiB); train {train_seconds:.0f}s, total {time.time() - t_start:.0f}s")
    return 0


# --------------------------------------------------------------------------------------------------
# The MTP head (step 5)
# --------------------------------------------------------------------------------------------------
MTP_FILE = "model-mtp.safetensors"


class MtpDraft(torch.nn.Module):
    """GLM-5's MTP layer in torch: enorm / hnorm / eh_proj around a one-layer GlmMoeDsaForCausalLM whose layer 0 is
    the MTP decoder layer (MoE, full indexer) and whose final norm is shared_head.norm; its lm_head is the main
    model's (frozen, shared)."""

    def __init__(self, main):
        super().__init__()
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm

        c = main.config
        d = c.to_dict()
        d.update(num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["sparse"], first_k_dense_replace=0,
                 layer_types=["indexed_attention"])
        for k in ("index_topk_pattern", "index_topk_freq"):
            d.pop(k, None)
        H = c.hidden_size
        self.layer = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**d)).float()
        last = main.model.layers[c.num_hidden_layers - 1]                 # warm start: the main model's last layer
        self.layer.model.layers[0].load_state_dict(last.state_dict())
        self.layer.model.norm.load_state_dict(main.model.norm.state_dict())
        self.layer.lm_head.weight = main.lm_head.weight                    # shared and frozen
        self.layer.model.embed_tokens = None
        self.enorm = GlmMoeDsaRMSNorm(H, c.rms_norm_eps)
        self.hnorm = GlmMoeDsaRMSNorm(H, c.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():   # start as "the hidden state, nudged by the next token": [0.1 I | I]
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, :H] = 0.1 * torch.eye(H)
            self.eh_proj.weight[:, H:] = torch.eye(H)

    def forward(self, emb_next, h):
        """emb_next [B, S, H] embeddings of t_{i+1}, h [B, S, H] the main model's final-normed h_i -> (g [B, S, H] the
        shared_head-normed output, the h a chained draft takes; logits [B, S, V] of t_{i+2})."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        g = self.layer.model(inputs_embeds=x, use_cache=False).last_hidden_state
        return g, self.layer.lm_head(g)

    def tensors(self, L: int) -> dict[str, torch.Tensor]:
        """The layer's tensors under their checkpoint names (model.layers.L.*, routed experts one by one)."""
        p = f"model.layers.{L}."
        out = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
               p + "eh_proj.weight": self.eh_proj.weight,
               p + "shared_head.norm.weight": self.layer.model.norm.weight}
        for n, v in self.layer.model.layers[0].state_dict().items():
            if n == "mlp.experts.gate_up_proj":
                Im = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[p + f"mlp.experts.{e}.gate_proj.weight"] = v[e, :Im]
                    out[p + f"mlp.experts.{e}.up_proj.weight"] = v[e, Im:]
            elif n == "mlp.experts.down_proj":
                for e in range(v.shape[0]):
                    out[p + f"mlp.experts.{e}.down_proj.weight"] = v[e]
            else:
                out[p + n] = v
        return {n: v.detach().float().contiguous() for n, v in out.items()}


def distill_kl(logits, teacher_logits, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(logits / T)) * T^2 per row [N] (Hinton et al.: the T^2 keeps the gradient's
    scale independent of T)."""
    p_log = F.log_softmax(teacher_logits / temperature, -1)
    q_log = F.log_softmax(logits / temperature, -1)
    return (p_log.exp() * (p_log - q_log)).sum(-1) * temperature ** 2


def mtp_loss(main, draft, batch, targets, reduce: bool = True, target: str = "corpus", temperature: float = 1.0,
             chain: int = 0, chain_weight: float = 0.5):
    """The MTP layer's loss for its guess of t_{i+2} from (h_i, t_{i+1}) over the target tokens. target="corpus": the
    cross-entropy of the corpus token t_{i+2}; target="teacher": distillation, the KL to the main model's own
    distribution at i+1 (what a draft is judged on is agreeing with the main model, not with the corpus).
    chain = 1..2 adds chained drafts 2..chain+1 as decoding runs them (the previous pass's output g as h, the next
    token as input; targets the teacher's distribution, or the corpus token, one further ahead), weighted by
    chain_weight. The chained passes run in parallel over the sequence, so their attention sees earlier chained
    rows where decoding sees the verified ones: an approximation, good enough to teach the layer its own g.
    With reduce=False: (corpus CE sum, count, first-draft agreements with the main model's greedy choice at i+1),
    the held-out figures whatever the objective."""
    T = batch.shape[1]
    with torch.no_grad():
        h_all = main.model(input_ids=batch[:, :-1], use_cache=False).last_hidden_state  # h_0..h_{T-2}, final-normed
        main_logits = main.lm_head(h_all[:, 1:])                                       # of t_2..t_{T-1} [B, T-2, V]
        main_next = main_logits.argmax(-1)                                             # greedy t_2..t_{T-1}
        hs = h_all[:, :-1]                                                             # h_0..h_{T-3}
        emb = main.model.embed_tokens(batch[:, 1:-1])                                  # t_1..t_{T-2}
    g, logits = draft(emb, hs)                                                         # [B, T-2, H], [B, T-2, V]
    mask = targets[:, 2:].reshape(-1).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 2:].reshape(-1), reduction="none")
    if not reduce:
        agree = (logits.argmax(-1) == main_next).reshape(-1).float()
        return (ce * mask).sum(), mask.sum(), (agree * mask).sum()

    def objective(lg, j: int) -> torch.Tensor:
        """Mean loss of logits lg [B, T-2-j, V] guessing t_{i+2+j} (pass j: draft j+1)."""
        m = targets[:, 2 + j:].reshape(-1).float()
        if target == "teacher":
            per = distill_kl(lg.reshape(-1, lg.shape[-1]), main_logits[:, j:].reshape(-1, lg.shape[-1]), temperature)
        else:
            per = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), batch[:, 2 + j:].reshape(-1), reduction="none")
        return (per * m).sum() / m.sum().clamp(min=1)

    loss = objective(logits, 0)
    for j in range(1, chain + 1):
        if T - 2 - j < 1:
            break
        # draft j+1 at row i: h = the previous pass's g_i (detached: pass j's own objective is left alone), input the
        # token t_{i+1+j} (the previous draft when it was accepted -- the only case where this draft counts)
        with torch.no_grad():
            emb_j = main.model.embed_tokens(batch[:, 1 + j:-1])                       # [B, T-2-j, H]
        g, logits = draft(emb_j, g[:, :-1].detach())
        loss = loss + chain_weight * objective(logits, j)
    return loss


def self_generated_stream(main, tok, chats: list[list[dict]], n_prompts: int, new_tokens: int, seed: int,
                          batch: int = 32) -> tuple[Stream, dict]:
    """Prompts cut from (training-split) chats before an assistant turn, each continued greedily by the main model for
    `new_tokens` tokens, eos ignored as `scripts/bench_mtp.py` decodes: the text the head drafts on when the main
    model decodes. Targets: the generated tokens (the main model's own argmax, so corpus = teacher's greedy choice).
    Prompts of one length run as one batch (no padding)."""
    rng = random.Random(seed)
    prompts = []
    for msgs in rng.sample(chats, min(n_prompts, len(chats))):
        cuts = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        prompts.append(tok.encode(render_chat(msgs[:rng.choice(cuts)], add_generation_prompt=True)).ids)
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    ids, starts, tmask, distinct = [], [], [], set()
    with torch.no_grad():
        for n in sorted(by_len):
            group = by_len[n]
            for b in range(0, len(group), batch):
                x = torch.tensor(group[b:b + batch])                                   # [b, n]
                out = main(input_ids=x, use_cache=True)
                cache, seqs = out.past_key_values, [x]
                for _ in range(new_tokens):
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)                   # [b, 1]
                    seqs.append(nxt)
                    out = main(input_ids=nxt, past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                for row in torch.cat(seqs, 1).tolist():
                    starts.append(len(ids))
                    ids += row
                    tmask += [False] * n + [True] * new_tokens
                    distinct.add(tuple(row[n:n + 16]))
    stats = {"prompts": len(prompts), "new_tokens": new_tokens, "tokens": len(ids),
             "distinct_first_16_tokens": len(distinct)}
    return Stream(ids, starts, tmask), stats


def sample_mtp_batch(prose: Stream, chat: Stream, own: Stream | None, rows: int, length: int, args, gen):
    """sample_batch's rows, of which a --mtp-self-share of them (binomial) from the self-generated stream `own`."""
    n_own = 0
    if own is not None:
        n_own = int(torch.binomial(torch.tensor(float(rows)), torch.tensor(args.mtp_self_share), generator=gen).item())
    parts = [own.rows(n_own, length + 1, gen)] if n_own else []
    if rows - n_own:
        parts.append(sample_batch(prose, chat, rows - n_own, length, args.chat_share, gen))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train_mtp_head(args, argv) -> int:
    """Step 5: the MTP layer on the frozen model in --out (see the module docstring)."""
    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import GlmMoeDsaForCausalLM

    from coli.safetensors_io import write_safetensors
    transformers.logging.set_verbosity_error()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    def log(msg: str):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    out: Path = args.out
    main_bytes = (out / "model.safetensors").read_bytes()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    # the same corpus, chats and held-out split as the main model's training (same seeds)
    rng = random.Random(args.seed)
    train_mods, heldout_mods, _ = gather_corpus(args.heldout_every)
    train_chats = make_chats(train_mods, rng, args.small_talk_share)
    heldout_chats = make_chats(heldout_mods, random.Random(args.seed + 1), 0.0)
    prose, chat = build_streams(tok, train_mods, train_chats, rng)
    h_prose, h_chat = build_streams(tok, heldout_mods, heldout_chats, random.Random(args.seed + 2))
    heldout = sample_batch(h_prose, h_chat, args.heldout_rows, args.seq_len, args.chat_share,
                           torch.Generator().manual_seed(args.seed + 3))
    log(f"corpus: {len(prose)} prose + {len(chat)} chat tokens; held out {len(h_prose)} + {len(h_chat)}")

    main = GlmMoeDsaForCausalLM.from_pretrained(out).float().eval()
    for q in main.parameters():
        q.requires_grad_(False)
    own, own_stats = None, None
    if args.mtp_self_share > 0:
        # training-split chats only: the held-out modules stay unseen by the head
        t_gen = time.time()
        own, own_stats = self_generated_stream(main, tok, train_chats, args.mtp_self_prompts, args.mtp_self_tokens,
                                               args.seed + 20)
        own_stats["seconds"] = round(time.time() - t_gen, 1)
        log(f"self-generated: {own_stats}")
    torch.manual_seed(args.seed)
    draft = MtpDraft(main)
    draft.train()
    params = [q for n, q in draft.named_parameters() if q.requires_grad and "lm_head" not in n]
    n_params = sum(q.numel() for q in params)
    log(f"MTP layer: {n_params / 1e6:.3f} M trainable parameters")
    decay = [q for q in params if q.ndim >= 2]
    no_decay = [q for q in params if q.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.mtp_lr, betas=(0.9, 0.95))
    routers = RouterTap(draft.layer)
    attn_tap = AttentionTap(draft.layer, args.indexer_kl_rows)
    indexer_params = {id(q) for m in attn_tap.layers for q in m.indexer.parameters()}
    gen = torch.Generator().manual_seed(args.seed + 10)

    @torch.no_grad()
    def evaluate_mtp(chunk: int = 8) -> tuple[float, float]:
        draft.eval()
        tot = cnt = agree = 0.0
        for i in range(0, len(heldout[0]), chunk):
            s_, n_, a_ = mtp_loss(main, draft, heldout[0][i:i + chunk], heldout[1][i:i + chunk], reduce=False)
            tot, cnt, agree = tot + s_.item(), cnt + n_.item(), agree + a_.item()
        draft.train()
        return tot / cnt, agree / cnt

    history = []
    short_steps = int(args.mtp_steps * args.short_frac)
    t_train = time.time()
    with dense_indexer_shortcut():
        loss0, acc0 = evaluate_mtp()
        log(f"held-out MTP loss at init {loss0:.3f}, first-draft acceptance {acc0:.3f}")
        for step in range(args.mtp_steps):
            seq = args.short_seq_len if step < short_steps else args.seq_len
            batch, targets = sample_mtp_batch(prose, chat, own, max(1, args.batch_tokens // seq), seq, args, gen)
            lr = lr_at(step, args.mtp_steps, args.mtp_lr, args.warmup, args.min_lr_frac)
            for group in opt.param_groups:
                group["lr"] = lr
            routers.reset()
            attn_tap.enabled = True
            loss = mtp_loss(main, draft, batch, targets, target=args.mtp_target, temperature=args.mtp_temperature,
                            chain=args.mtp_chain, chain_weight=args.mtp_chain_weight)
            attn_tap.enabled = False
            kl = attn_tap.loss()
            total = loss + kl if kl is not None else loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_([q for q in params if id(q) not in indexer_params], args.clip)
            opt.step()
            if args.bias_update_rate:
                routers.balance(args.bias_update_rate)
            if step % args.log_every == 0 or step == args.mtp_steps - 1:
                rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr, 6),
                       "elapsed_s": round(time.time() - t_train, 1)}
                if step and (step % args.eval_every == 0 or step == args.mtp_steps - 1):
                    rec["heldout_loss"], rec["heldout_first_draft_acceptance"] = (round(v, 4) for v in evaluate_mtp())
                history.append(rec)
                log(f"step {step:4d}  MTP loss {loss.item():.3f}  lr {lr:.2e}" +
                    (f"  held-out {rec['heldout_loss']:.3f}, acceptance {rec['heldout_first_draft_acceptance']:.3f}"
                     if "heldout_loss" in rec else ""))
    train_seconds = time.time() - t_train
    final_loss, final_acc = evaluate_mtp()

    L = main.config.num_hidden_layers
    tensors = draft.tensors(L)
    write_safetensors(out / MTP_FILE, {n: ("F32", v.numpy()) for n, v in tensors.items()})
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        main_names = list(f.keys())
    weight_map = {**{n: "model.safetensors" for n in main_names}, **{n: MTP_FILE for n in tensors}}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": (out / "model.safetensors").stat().st_size + (out / MTP_FILE).stat().st_size},
         "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n")
    assert (out / "model.safetensors").read_bytes() == main_bytes, "the main weights changed"
    record = {
        "command": "python scripts/train_demo_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed, "steps": args.mtp_steps, "lr": args.mtp_lr, "batch_tokens": args.batch_tokens,
        "target": args.mtp_target, "temperature": args.mtp_temperature, "self_generated_share": args.mtp_self_share,
        "self_generated": own_stats, "chain": args.mtp_chain, "chain_weight": args.mtp_chain_weight,
        "trainable_parameters": n_params, "mtp_layer": L,
        "initial_heldout_loss": round(loss0, 4), "initial_heldout_first_draft_acceptance": round(acc0, 4),
        "heldout_loss": round(final_loss, 4), "heldout_first_draft_acceptance": round(final_acc, 4),
        "acceptance_note": "teacher-forced on held-out rows: the MTP guess of t+2 equals the main model's greedy "
                           "choice there (what a first draft is accepted on in greedy decoding)",
        "train_wall_seconds": round(train_seconds, 1), "total_wall_seconds": round(time.time() - t_start, 1),
        "threads": args.threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "history": history,
    }
    (out / "training-mtp.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"saved {MTP_FILE} ({(out / MTP_FILE).stat().st_size / 2**20:.1f} MiB); held-out first-draft acceptance "
        f"{final_acc:.3f}; train {train_seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
