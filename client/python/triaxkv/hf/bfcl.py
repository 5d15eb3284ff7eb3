"""BFCL v4 multi-turn conversations rendered in ChatML the way kvproxy-18m
was trained on them, with a role span for every byte: the Python port of
client/frontend/bfcl.h (the same text and spans byte for byte).

  <|im_start|>system\\n                                      delimiter
  You are a helpful assistant ... one JSON object per line:\\n  system
  {doc 1}\\n{doc 2}\\n...{doc N}                               tool_schema
  <|im_end|>\\n                                               delimiter
then per exchange:
  <|im_start|>user\\n{content}<|im_end|>\\n                    delimiter user delimiter
  <|im_start|>assistant\\n                                    delimiter
  <tool_call>\\n[{call}, {call}]\\n</tool_call>                tool_call
  <|im_end|>\\n<|im_start|>tool\\n                             delimiter
  {"status": "ok"}                                           tool_result
  <|im_end|>\\n                                               delimiter
Turn 0 is the system turn plus the first exchange; turn k > 0 is exchange k.
Adjacent pieces of one role inside a turn form one span. Token counts are
byte counts (kvproxy-18m is byte-level; the frontend adds one BOS).
"""

import json
import os

SYSTEM_INSTRUCTION = (
    "You are a helpful assistant that can call functions. When a request "
    "needs tools, reply with <tool_call> followed by a list of calls in Python "
    "syntax and </tool_call>. Available functions, one JSON object per line:\n")

FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json", "TwitterAPI": "posting_api.json",
    "MessageAPI": "message_api.json", "TicketAPI": "ticket_api.json",
    "MathAPI": "math_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
}
_MESSAGE_ROLES = {"user": "user", "system": "system", "assistant": "assistant",
                  "tool": "tool_result"}


class Rendered:
    """text (bytes); turns: list of (begin, end, spans), spans a list of
    (role, begin, length) covering [begin, end); docs/turns kept of total."""

    def __init__(self, id):
        self.id = id
        self.text = b""
        self.turns = []
        self.docs_total = self.docs_kept = self.turns_total = self.turns_kept = 0

    def truncated(self):
        return self.docs_kept < self.docs_total or self.turns_kept < self.turns_total

    def all_spans(self):
        return [s for _, _, spans in self.turns for s in spans]


class _Builder:
    def __init__(self):
        self.text = bytearray()
        self.spans = []
        self.turn_begin = 0
        self.turn_span = 0

    def add(self, role, piece):
        piece = piece.encode("utf-8") if isinstance(piece, str) else piece
        if not piece:
            return
        if len(self.spans) > self.turn_span and self.spans[-1][0] == role:
            r, b, n = self.spans[-1]
            self.spans[-1] = (r, b, n + len(piece))
        else:
            self.spans.append((role, len(self.text), len(piece)))
        self.text += piece

    def end_turn(self, turns):
        turns.append((self.turn_begin, len(self.text), self.spans[self.turn_span:]))
        self.turn_begin = len(self.text)
        self.turn_span = len(self.spans)


def _exchange(messages, calls):
    s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    s += ("<|im_start|>assistant\n<tool_call>\n[" + ", ".join(calls) +
          "]\n</tool_call><|im_end|>\n<|im_start|>tool\n{\"status\": \"ok\"}<|im_end|>\n")
    return len(s.encode("utf-8"))


def _system_bytes(docs, kept):
    n = len(b"<|im_start|>system\n") + len(SYSTEM_INSTRUCTION.encode()) + len(b"<|im_end|>\n")
    return n + sum(len(docs[i]) + (1 if i else 0) for i in range(kept))


def _jsonl(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {line_no}: {e}") from None
    return out


class BfclData:
    """The multi_turn_base entries, their ground truth and the function
    docs (each doc line re-serialized with json.dumps' defaults) of a data
    directory."""

    def __init__(self, data_dir):
        d = os.path.join(data_dir, "bfcl")
        self.entries = {e["id"]: e for e in
                        _jsonl(os.path.join(d, "BFCL_v4_multi_turn_base.json"))}
        self.answers = {a["id"]: a for a in _jsonl(
            os.path.join(d, "possible_answer", "BFCL_v4_multi_turn_base.json"))}
        self.docs = {cls: [json.dumps(j, ensure_ascii=True) for j in
                           _jsonl(os.path.join(d, "multi_turn_func_doc", f))]
                     for cls, f in FUNC_DOC_FILES.items()}

    def render(self, id, max_bytes=0):
        """The conversation `id`; when longer than max_bytes (0: no limit),
        trailing exchanges are dropped until it fits with one doc line, then
        doc lines are kept in order while they fit (as RenderBfcl)."""
        if id not in self.entries:
            raise KeyError(f"BFCL id {id!r} not found")
        if id not in self.answers:
            raise KeyError(f"BFCL id {id!r} has no possible_answer entry")
        entry, truth = self.entries[id], self.answers[id]["ground_truth"]
        turns = entry["question"]
        if len(truth) != len(turns):
            raise ValueError(f"entry {id}: {len(turns)} question turns but "
                             f"{len(truth)} ground_truth turns")
        if not turns:
            raise ValueError(f"entry {id}: no turns")
        docs = []
        for cls in entry["involved_classes"]:
            if cls not in self.docs:
                raise KeyError(f"entry {id}: no function docs for class {cls!r}")
            docs.extend(self.docs[cls])
        for t in turns:
            for m in t:
                if m["role"] not in _MESSAGE_ROLES:
                    raise ValueError(f"entry {id}: message role {m['role']!r} is not "
                                     "one of user, system, assistant, tool")
        rc = Rendered(id)
        rc.docs_total, rc.turns_total = len(docs), len(turns)
        ex = [_exchange(turns[t], truth[t]) for t in range(len(turns))]
        turns_kept, docs_kept = len(turns), len(docs)
        if max_bytes > 0:
            min_docs = 1 if docs else 0
            while turns_kept > 1 and _system_bytes(docs, min_docs) + sum(
                    ex[:turns_kept]) > max_bytes:
                turns_kept -= 1
            if _system_bytes(docs, min_docs) + sum(ex[:turns_kept]) > max_bytes:
                raise ValueError(
                    f"entry {id}: the system turn with one doc line and the first "
                    f"exchange need {_system_bytes(docs, min_docs) + ex[0]} bytes, "
                    f"over the context budget of {max_bytes}")
            docs_kept = min_docs
            while docs_kept < len(docs) and _system_bytes(docs, docs_kept + 1) + sum(
                    ex[:turns_kept]) <= max_bytes:
                docs_kept += 1
        rc.turns_kept, rc.docs_kept = turns_kept, docs_kept
        b = _Builder()
        b.add("delimiter", "<|im_start|>system\n")
        b.add("system", SYSTEM_INSTRUCTION)
        for i in range(docs_kept):
            if i:
                b.add("tool_schema", "\n")
            b.add("tool_schema", docs[i])
        b.add("delimiter", "<|im_end|>\n")
        for t in range(turns_kept):
            for m in turns[t]:
                b.add("delimiter", f"<|im_start|>{m['role']}\n")
                b.add(_MESSAGE_ROLES[m["role"]], m["content"])
                b.add("delimiter", "<|im_end|>\n")
            b.add("delimiter", "<|im_start|>assistant\n")
            b.add("tool_call", "<tool_call>\n[" + ", ".join(truth[t]) + "]\n</tool_call>")
            b.add("delimiter", "<|im_end|>\n<|im_start|>tool\n")
            b.add("tool_result", "{\"status\": \"ok\"}")
            b.add("delimiter", "<|im_end|>\n")
            b.end_turn(rc.turns)
        rc.text = bytes(b.text)
        return rc


def turn_spans(rc, t):
    """The (role, num_tokens) spans of turn t for the manager, BOS joined to
    the first span (as kvdemo)."""
    return [(role, n + (1 if begin == 0 else 0)) for role, begin, n in rc.turns[t][2]]
