#!/usr/bin/env python3
"""Checks that a change to kernels/cuda leaves the generated device code alone.

Compares every kernel (`.entry`) of one set of PTX files ("before") with the
kernel of the same name in another set ("after"), whatever .cu file each was
compiled from, and the ptxas resource use of each (registers, spill
stores/loads, stack frame, barriers, shared memory). No GPU is needed, only
nvcc and ptxas.

Names are normalized before comparing, so that moving a kernel to another
file does not count as a change:
  * the per-file anonymous namespace (`_GLOBAL__N__<hash>_<len>_<file>_<hash>`
    and `_INTERNAL_<hash>_..._<hash>` in mangled names) becomes `ANON`;
  * basic-block labels (`$L__BB<function index>_<n>`) and local depots
    (`__local_depot<function index>`) lose the function's index in the file.
Everything else (instructions, registers, parameters, directives such as
.maxntid / .minnctapersm) must match exactly.

Usage:
  # PTX of each .cu file, with the flags of the Release build (sm_90a):
  scripts/ptx_compare.py compile OUT_DIR kernels/cuda/*.cu
  # Compare two sets of PTX files; exit status 1 on any difference:
  scripts/ptx_compare.py diff --before old/*.ptx --after OUT_DIR/*.ptx \
      [--before-ptxas old_ptxas.txt] [--show-diff]

`compile` runs nvcc -O3 -DNDEBUG -arch=sm_90a -std=c++17 -I<repo root> -ptx,
the options CMake's Release build gives nvcc (TRIAX_CUDA_ARCHS=90a); `diff`
runs `ptxas -v -arch=sm_90a` on each file unless a saved ptxas -v log is
given for the "before" side, and prints each kernel's SASS size in bytes
(sass=, its .text section in the cubin; readelf) with the "before" size
where they differ (not available with a saved log). A SASS size is a count
of instructions, not proof that they are the same ones.
"""

import argparse
import concurrent.futures
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = "sm_90a"


def tool(name):
    path = shutil.which(name) or os.path.join("/usr/local/cuda/bin", name)
    if not os.path.exists(path):
        sys.exit(f"{name} not found (PATH or /usr/local/cuda/bin)")
    return path


# ---- Name normalization ------------------------------------------------------

_ANON = re.compile(r"(\d+)(_GLOBAL__N__|_INTERNAL_)([0-9a-f]{8})_(\d+)_")


def normalize_names(text):
    """Replaces each length-prefixed anonymous-namespace identifier by ANON.

    The identifier is _GLOBAL__N__<hash>_<len>_<file>_<hash>, sometimes with
    a _<number> suffix; the mangled length prefix before it tells where it
    ends."""
    out, pos = [], 0
    for m in _ANON.finditer(text):
        if m.start() < pos:
            continue
        seg = m.start(2)
        base = m.end() + int(m.group(4))
        tail = re.match(r"_[0-9a-f]{8}", text[base:])
        if not tail:
            continue
        base += tail.end()
        digits, found = m.group(1), None
        for i in range(len(digits)):  # longest length prefix first
            n = int(digits[i:])
            if n >= base - seg and re.fullmatch(r"(_\d+)?", text[base:seg + n]):
                found = (m.start(1) + i, seg + n)
                break
        if not found:
            continue
        out.append(text[pos:found[0]])
        out.append("4ANON")
        pos = found[1]
    out.append(text[pos:])
    text = "".join(out)
    text = re.sub(r"\$L__BB\d+_", "$L__BB_", text)
    text = re.sub(r"__local_depot\d+", "__local_depot", text)
    return text


# ---- PTX parsing -------------------------------------------------------------

_TOP = re.compile(r"^(\.visible |\.weak )?(\.entry|\.func) ")
_DECL = re.compile(r"^(\.global|\.extern|\.const|\.shared|// \.globl)")


def entries(ptx_text):
    """{normalized kernel name: normalized text of its definition}."""
    lines = normalize_names(ptx_text).splitlines()
    result, name, body = {}, None, []
    for line in lines + [".entry __end__("]:
        if _TOP.match(line) or (name and _DECL.match(line)):
            if name:
                result[name] = "\n".join(body).rstrip() + "\n"
            name, body = None, []
            m = re.match(r"^(?:\.visible |\.weak )?(?:\.entry|\.func) (?:\([^)]*\) )?([^(\s]+)", line)
            if m and m.group(1) != "__end__":
                name = m.group(1)
        if name:
            body.append(line)
    return result


def globals_of(ptx_text):
    return sorted(l for l in normalize_names(ptx_text).splitlines()
                  if re.match(r"^\.(global|const) ", l))


# ---- ptxas -v ----------------------------------------------------------------

def ptxas_log(ptx_path, sass_sizes=None):
    """ptxas -v output; with sass_sizes (a dict), also the byte size of each
    kernel's SASS (.text.<kernel> of the cubin, read with readelf)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "out.cubin")
        r = subprocess.run([tool("ptxas"), "-v", f"-arch={ARCH}", ptx_path,
                            "-o", cubin], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"ptxas failed on {ptx_path}:\n{r.stderr}")
        if sass_sizes is not None and shutil.which("readelf"):
            elf = subprocess.run(["readelf", "-S", "-W", cubin],
                                 capture_output=True, text=True).stdout
            for m in re.finditer(r"\] \.text\.(\S+)\s+\S+\s+\S+\s+\S+\s+"
                                 r"([0-9a-f]+)", elf):
                sass_sizes[normalize_names(m.group(1))] = int(m.group(2), 16)
    return r.stdout + r.stderr


def resources(log):
    """{normalized kernel name: 'regs=.. spill=../.. stack=.. bar=.. smem=..'}."""
    log = normalize_names(log)
    out, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            out[cur] = {}
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", line)
        if m:
            out[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)),
                            spill_ld=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[cur]["regs"] = int(m.group(1))
            b = re.search(r"used (\d+) barriers", line)
            out[cur]["barriers"] = int(b.group(1)) if b else 0
            s = re.search(r"(\d+) bytes smem", line)
            out[cur]["smem"] = int(s.group(1)) if s else 0
            c = re.search(r"(\d+) bytes cumulative stack size", line)
            out[cur]["cum_stack"] = int(c.group(1)) if c else 0
    return {k: " ".join(f"{f}={v[f]}" for f in sorted(v)) for k, v in out.items()}


def short(name):
    """EncodeKernel, MmaAttentionKernel<128,1,4,0>, ... for the table."""
    m = re.search(r"4ANON(\d+)", name)
    if not m:
        return name
    n = int(m.group(1))
    ident, rest = name[m.end():m.end() + n], name[m.end() + n:]
    if rest.startswith("I"):
        args = re.findall(r"L[a-z](\d+)E", rest[:rest.find("EE") + 2])
        ident += "<" + ",".join(args) + ">"
    return ident


# ---- Commands ----------------------------------------------------------------

def cmd_compile(args):
    os.makedirs(args.out_dir, exist_ok=True)
    nvcc = tool("nvcc")

    def one(src):
        stem = os.path.splitext(os.path.basename(src))[0]
        dst = os.path.join(args.out_dir, stem + ".ptx")
        cmd = [nvcc, "-O3", "-DNDEBUG", f"-arch={ARCH}", "-std=c++17",
               f"-I{REPO}", "-ptx", src, "-o", dst]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return src, r

    failed = False
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        for src, r in ex.map(one, args.sources):
            print(f"{'ok  ' if r.returncode == 0 else 'FAIL'} {src}")
            if r.returncode != 0:
                failed = True
                print(r.stderr)
    return 1 if failed else 0


def cmd_diff(args):
    before, after, b_res, a_res, b_sass, a_sass = {}, {}, {}, {}, {}, {}
    b_glob, a_glob = [], []
    for path in args.before:
        text = open(path).read()
        before.update(entries(text))
        b_glob += globals_of(text)
        if not args.before_ptxas:
            b_res.update(resources(ptxas_log(path, b_sass)))
    if args.before_ptxas:
        b_res.update(resources(open(args.before_ptxas).read()))
    for path in args.after:
        text = open(path).read()
        e = entries(text)
        dup = set(e) & set(after)
        if dup:
            print(f"kernel defined in two files: {sorted(map(short, dup))}")
        after.update(e)
        a_glob += [f"{os.path.basename(path)}: {g}" for g in globals_of(text)]
        a_res.update(resources(ptxas_log(path, a_sass)))

    bad = 0
    print(f"{'kernel':<34} {'PTX':<10} ptxas (after)")
    for name in sorted(set(before) | set(after), key=short):
        if name not in after:
            print(f"{short(name):<34} MISSING in after")
            bad += 1
            continue
        if name not in before:
            print(f"{short(name):<34} NEW (not in before)")
            bad += 1
            continue
        same = before[name] == after[name]
        res_same = b_res.get(name) == a_res.get(name)
        status = "identical" if same else "DIFFERS"
        res = a_res.get(name, "?") if res_same else \
            f"DIFFERS before: {b_res.get(name)} after: {a_res.get(name)}"
        if name in a_sass:
            res += f" sass={a_sass[name]}"
            if name in b_sass and b_sass[name] != a_sass[name]:
                res += f" (before {b_sass[name]})"
        print(f"{short(name):<34} {status:<10} {res}")
        if not same or not res_same:
            bad += 1
        if not same and args.show_diff:
            d = difflib.unified_diff(before[name].splitlines(),
                                     after[name].splitlines(), "before",
                                     "after", lineterm="", n=2)
            print("\n".join(list(d)[:args.show_diff]))
    print("globals before:", *b_glob, sep="\n  ")
    print("globals after:", *a_glob, sep="\n  ")
    print(f"{len(after)} kernels after, {len(before)} before: "
          f"{'all identical' if bad == 0 else f'{bad} differ'}")
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("out_dir")
    c.add_argument("sources", nargs="+")
    c.add_argument("-j", "--jobs", type=int, default=2)
    d = sub.add_parser("diff")
    d.add_argument("--before", nargs="+", required=True)
    d.add_argument("--after", nargs="+", required=True)
    d.add_argument("--before-ptxas", help="saved `ptxas -v` log of --before")
    d.add_argument("--show-diff", type=int, nargs="?", const=60, default=0,
                   help="print up to N lines of each differing kernel's diff")
    args = p.parse_args()
    return cmd_compile(args) if args.cmd == "compile" else cmd_diff(args)


if __name__ == "__main__":
    sys.exit(main())
