"""The reference model: a small decoder that labkit trains itself on a language it generates, so
quality deltas (perplexity, greedy-token agreement) of lossy variants mean something.

The language (`make_corpus`) lives in the `reference` preset's 512-token vocabulary. A sequence is
BOS followed by a stream of clauses, cut at `seq_len`; each clause is one of

- a sentence (35%): `Det [Adj] Noun Verb [Det [Adj] Noun] [Prep Det Noun] .` Determiner, noun and
  verb agree in number (singular or plural forms are separate tokens); nouns are Zipf-distributed;
  each noun allows 4 verbs and each verb 6 object nouns, tables fixed by `LANGUAGE_SEED`;
- a counting run (15%): `# n n+1 n+2 ... .`, 4 to 12 numbers, modulo 32;
- a copy (30%): `[ s1 ... sk ] [ s1 ... sk ]`, 3 to 8 symbols, each allowing 3 successors
  (a fixed table), repeated exactly;
- a recall (20%): `k1 = v1 ; ... kn = vn ; ? ki = vi .`, 2 to 4 symbol keys with number values,
  then one of the keys asked again and its value repeated.

So a greedy continuation is mostly predictable: agreement, counting, copying and recall are
deterministic once their context is seen, and the copy and recall need attention over a span.

Weights are stored in the safetensors format, written and read here with only the standard library
and torch (no pickle, so loading is safe): an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}, then the raw bytes
(https://github.com/huggingface/safetensors#format).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
import struct
import time
from pathlib import Path
from typing import Callable

import torch

from labkit.config import MODELS, ConfigError
from labkit.hardware import DATA_DIR
from labkit.blocks.model import Decoder, build_model
from labkit.blocks.training import lm_loss

REFERENCE_DIR = DATA_DIR / "reference"
REGENERATE = "labkit train-reference"  # named in every error about the shipped weights
# The speculative experiment's draft: the same language and vocabulary, half the layers, half the
# width (about 1/7 of the reference's parameters, 2x cheaper per decode step on one CPU thread).
SHAPES = {"reference": MODELS["reference"],
          "draft": dataclasses.replace(MODELS["reference"], num_layers=2, hidden_size=64,
                                       num_heads=2, num_kv_heads=1, ffn_size=172)}
COMMANDS = {"reference": REGENERATE, "draft": f"{REGENERATE} --draft"}  # how to regenerate each
LANGUAGE_SEED = 1234  # the grammar's tables; the corpus seed only draws text from them
HELDOUT_SEED = 999_999  # held-out text; training refuses this seed
CALIBRATION_SEED = 999_998  # calibration text of calibrated quantization (labkit.blocks.calibrated):
# never trained on, and not the held-out text its perplexity is measured on

# Token ids: specials, then one block per word class (sizes sum to the 512-token vocabulary).
BOS, STOP, OPEN, CLOSE, EQUALS, SEMI, ASK, HASH = range(8)
NUMBERS = range(8, 40)  # 0..31
DETS = (range(40, 44), range(44, 48))  # (singular, plural)
NOUNS = (range(48, 112), range(112, 176))  # noun i: singular 48 + i, plural 112 + i
VERBS = (range(176, 208), range(208, 240))
ADJS, PREPS, SYMBOLS = range(240, 272), range(272, 280), range(280, 512)
CLAUSE_WEIGHTS = (0.35, 0.15, 0.3, 0.2)  # sentence, count, copy, recall


class Language:
    """The fixed tables of the grammar and a seeded writer of clauses."""

    def __init__(self, seed: int):
        table = random.Random(LANGUAGE_SEED)
        self.verbs_of = [table.sample(range(32), 4) for _ in range(64)]  # noun -> allowed verbs
        self.objects_of = [table.sample(range(64), 6) for _ in range(32)]  # verb -> object nouns
        self.next_symbols = [table.sample(SYMBOLS, 3) for _ in SYMBOLS]  # symbol -> successors
        self.noun_weights = [1.0 / (i + 1) for i in range(64)]  # Zipf
        self.rng = random.Random(seed)

    def noun_phrase(self, noun: int | None = None) -> tuple[list[int], int, bool]:
        """(tokens, noun, plural): a determiner, maybe an adjective, the noun; number agrees."""
        r = self.rng
        plural = r.random() < 0.4
        noun = r.choices(range(64), self.noun_weights)[0] if noun is None else noun
        adj = [r.choice(ADJS)] if r.random() < 0.3 else []
        return [r.choice(DETS[plural]), *adj, NOUNS[plural][noun]], noun, plural

    def sentence(self) -> list[int]:
        r = self.rng
        subject, noun, plural = self.noun_phrase()
        verb = r.choice(self.verbs_of[noun])
        out = subject + [VERBS[plural][verb]]
        if r.random() < 0.6:
            out += self.noun_phrase(r.choice(self.objects_of[verb]))[0]
        if r.random() < 0.3:
            out += [r.choice(PREPS)] + self.noun_phrase()[0]
        return out + [STOP]

    def count(self) -> list[int]:
        start, n = self.rng.randrange(32), self.rng.randint(4, 12)
        return [HASH] + [NUMBERS[(start + i) % 32] for i in range(n)] + [STOP]

    def copy(self) -> list[int]:
        span = [self.rng.choice(SYMBOLS)]
        for _ in range(self.rng.randint(2, 7)):
            span.append(self.rng.choice(self.next_symbols[span[-1] - SYMBOLS.start]))
        return [OPEN, *span, CLOSE, OPEN, *span, CLOSE]

    def recall(self) -> list[int]:
        r = self.rng
        keys = r.sample(SYMBOLS, r.randint(2, 4))
        values = [r.choice(NUMBERS) for _ in keys]
        out = [t for k, v in zip(keys, values) for t in (k, EQUALS, v, SEMI)]
        i = r.randrange(len(keys))
        return out + [ASK, keys[i], EQUALS, values[i], STOP]

    def sequence(self, seq_len: int) -> list[int]:
        out = [BOS]
        kinds = (self.sentence, self.count, self.copy, self.recall)
        while len(out) < seq_len:
            out += self.rng.choices(kinds, CLAUSE_WEIGHTS)[0]()
        return out[:seq_len]


def make_corpus(num_sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """(num_sequences, seq_len) int64 token ids of the language, the same for the same seed."""
    lang = Language(seed)
    rows = [lang.sequence(seq_len) for _ in range(num_sequences)]
    return torch.tensor(rows, dtype=torch.long)


def heldout(num_sequences: int, seq_len: int) -> torch.Tensor:
    """Held-out text (its own seed, never trained on) for perplexity and agreement measurements."""
    return make_corpus(num_sequences, seq_len, HELDOUT_SEED)


def calibration_text(num_sequences: int, seq_len: int) -> torch.Tensor:
    """Calibration text for GPTQ, AWQ and SmoothQuant: its own seed, neither trained on nor held out."""
    return make_corpus(num_sequences, seq_len, CALIBRATION_SEED)


# ---- training ----------------------------------------------------------------------------------

DEFAULTS = {"steps": 1400, "seed": 0, "batch_size": 8, "seq_len": 256, "lr": 3e-3}
DRAFT_DEFAULTS = {**DEFAULTS, "steps": 2000}  # 2-3 minutes on one CPU thread
QUICK = {"steps": 8, "batch_size": 2, "seq_len": 32}  # `--quick`: seconds, for tests and demos
NUM_EVAL_SEQUENCES = 32  # held-out sequences behind the recorded perplexities


@contextlib.contextmanager
def one_thread():
    """Train on one intra-op thread: the same bits on every run (reductions split by thread
    count round differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to lr / 10."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def perplexity(model: Decoder, tokens: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) of the model over (N, T) token ids."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in tokens.split(batch_size):
        chunk = chunk.to(device)
        loss = lm_loss(model(chunk[:, :-1]), chunk[:, 1:])
        total, count = total + loss.item() * chunk[:, 1:].numel(), count + chunk[:, 1:].numel()
    return math.exp(total / count)


def train_reference(*, steps: int = DEFAULTS["steps"], seed: int = DEFAULTS["seed"],
                    batch_size: int = DEFAULTS["batch_size"], seq_len: int = DEFAULTS["seq_len"],
                    lr: float = DEFAULTS["lr"], log: Callable[[int, float], None] | None = None,
                    name: str = "reference") -> tuple[Decoder, dict]:
    """Train the `reference` preset (or, `name="draft"`, the draft shape) from seed `seed` on
    fresh text of the language (batch i is the i-th draw of a generator seeded with `seed`):
    AdamW, fp32, CPU, one thread. Returns the model and stats (settings, final loss, held-out
    perplexity before and after, seconds)."""
    if seed in (HELDOUT_SEED, CALIBRATION_SEED):
        raise ConfigError(f"seed {seed} draws the held-out or calibration text; choose another")
    with one_thread():
        model = build_model(SHAPES[name], seed=seed)
        evaluation = heldout(NUM_EVAL_SEQUENCES, seq_len)
        random_ppl = perplexity(model, evaluation)
        start = time.perf_counter()
        losses = _train_loop(model, Language(seed), steps, batch_size, seq_len, lr, log)
        train_s = time.perf_counter() - start
        stats = {"steps": steps, "seed": seed, "batch_size": batch_size, "seq_len": seq_len,
                 "lr": lr, "final_loss": losses[-1] if losses else math.nan,
                 "heldout_ppl": perplexity(model.eval(), evaluation),
                 "random_init_ppl": random_ppl, "train_s": train_s}
    return model, stats


def _train_loop(model: Decoder, lang: Language, steps: int, batch_size: int, seq_len: int,
                lr: float, log) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(steps):
        batch = torch.tensor([lang.sequence(seq_len + 1) for _ in range(batch_size)])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log is not None:
            log(step, losses[-1])
    return losses


# ---- storage: the safetensors format, without the safetensors package -----------------------

DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # The raw storage bytes; labkit runs on little-endian hosts (x86, ARM), as the format wants.
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def save_weights(state: dict[str, torch.Tensor] | torch.nn.Module, path: str | Path,
                 metadata: dict[str, str] | None = None) -> None:
    """Write tensors as a .safetensors file: names sorted and JSON keys sorted, so the same
    tensors and metadata give the same bytes."""
    state = state.state_dict() if isinstance(state, torch.nn.Module) else state
    header, chunks, offset = {}, [], 0
    for name in sorted(state):
        data = _tensor_bytes(state[name])
        header[name] = {"dtype": DTYPE_CODES[state[name].dtype], "shape": list(state[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad with spaces: the tensor bytes start 8-byte aligned
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def read_header(raw: bytes) -> tuple[dict, int]:
    """(header without __metadata__, offset of the tensor bytes); ValueError if malformed."""
    if len(raw) < 8:
        raise ValueError("shorter than the 8-byte header length")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > len(raw) - 8:
        raise ValueError("header length runs past the end of the file")
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    return header, 8 + size


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file (read through its JSON header only: no code runs)."""
    raw = Path(path).read_bytes()
    header, base = read_header(raw)
    state = {}
    for name, entry in header.items():
        begin, end = (base + o for o in entry["data_offsets"])
        dtype, shape = CODE_DTYPES[entry["dtype"]], entry["shape"]
        if not base <= begin <= end <= len(raw):
            raise ValueError(f"{name}: data offsets outside the file")
        flat = torch.frombuffer(bytearray(raw[begin:end]), dtype=dtype) if end > begin else \
            torch.empty(0, dtype=dtype)
        state[name] = flat.reshape(shape)
    return state


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- the shipped reference ---------------------------------------------------------------------

def write_reference(model: Decoder, stats: dict, out_dir: str | Path = REFERENCE_DIR,
                    name: str = "reference") -> dict:
    """Write `<name>.safetensors` and `<name>.json` (settings, checksum, perplexities,
    environment; the draft's shape too) into `out_dir`; returns the JSON record."""
    from labkit import hardware

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: stats[k] for k in ("steps", "seed", "batch_size", "seq_len", "lr")}
    # Only what fixes the bits goes into the file (no time, no CPU name): same run, same checksum.
    shape = {} if name == "reference" else {"model": name}  # the reference's bytes as before
    save_weights(model, out / f"{name}.safetensors",
                 {"preset": "reference", **shape, "torch": torch.__version__, "num_threads": "1",
                  **settings})
    record = {"file": f"{name}.safetensors", "sha256": sha256(out / f"{name}.safetensors"),
              "preset": "reference", **shape, **stats, "heldout_sequences": NUM_EVAL_SEQUENCES,
              "num_threads": 1, "torch": torch.__version__, "cpu": hardware.cpu_info().model,
              "command": COMMANDS[name]}
    if shape:
        record["shape"] = dataclasses.asdict(SHAPES[name])
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def reference_record(folder: str | Path = REFERENCE_DIR, name: str = "reference") -> dict:
    """The recorded settings, checksum and perplexities of the shipped reference (or draft)."""
    path = Path(folder) / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"no {name} record at {path}; regenerate it with `{COMMANDS[name]}`")
    return json.loads(path.read_text())


def load_reference(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
                   folder: str | Path = REFERENCE_DIR, name: str = "reference") -> Decoder:
    """The trained `reference` preset model (or, `name="draft"`, its draft) on `device` in
    `dtype`, in eval mode. The file's sha256 is checked against `<name>.json` first: missing or
    changed -> one-line ConfigError naming the command that regenerates it."""
    record, command = reference_record(folder, name), COMMANDS[name]
    path = Path(folder) / record["file"]
    if not path.is_file():
        raise ConfigError(f"no {name} weights at {path}; regenerate them with `{command}`")
    if sha256(path) != record["sha256"]:
        raise ConfigError(f"{path} does not match the checksum in {name}.json; regenerate it "
                          f"with `{command}`")
    model = build_model(SHAPES[name], device="meta")
    model.load_state_dict(load_weights(path), assign=True)
    return model.to(device=device, dtype=dtype).eval()
