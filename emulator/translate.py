#!/usr/bin/env python3
"""Translate Metal Shading Language kernels into C++ for the MSL-on-CPU emulator.

Subcommands (run by emulator/CMakeLists.txt at build time, and by the tests):

  shader --input F.metal --output F.cc --stem S --cxx CXX
      Preprocess F.metal with the C++ compiler CXX (``-E``, ``__METAL_VERSION__=300``, local
      ``#include "x.h"`` resolved next to F), rewrite the Metal-only syntax into C++ that compiles
      against shim/metal_shim.h (runtime) or shim/metal_strict.h (strict pass), and append one
      launcher per instantiated kernel plus a table ``jfm::rt::jfm_table_S``. Writes F.cc and
      F.cc.kernels (the kernel names, one per line).
  registry --output R.cc [--counting] S1.cc.kernels S2.cc.kernels ...
      Write the list of tables (and of the counting variants' tables, compiled from the same
      F.cc with -DJFM_COUNTING); fails if two files define the same kernel name.
  strict --input F.cc --clang CLANG
      The strict pass: clang -fsyntax-only in C++14 with device/constant/threadgroup as distinct
      address spaces (see shim/metal_strict.h).
  check --input F.metal --cxx CXX --clang CLANG
      shader + strict on a temporary file (used by tests on deliberately broken shaders).

Rewrites: ``kernel`` and Metal attributes are removed (``[[buffer(n)]]`` and builtin attributes
feed the launcher); ``threadgroup T x[N];`` declared in a function body becomes a reference into
the threadgroup's memory (``JFM_TGV``); ``float4(a, b)``-style vector constructors become
``jfm_make<float4>(a, b)``; swizzles ``v.xy`` become ``v.JFM_SWIZZLE(xy, 0, 1)``; unsuffixed
floating literals get ``f`` (Metal has no double) and
``1.5h`` becomes ``half(1.5f)``. Anything the emulator does not support (an unknown attribute, a
kernel parameter without a binding, an unsupported builtin type, ``[[threadgroup(n)]]``
arguments) is an error naming file:line; nothing is silently dropped. So is a ``for`` loop that
subscripts a fragment array with its variable but lacks ``#pragma clang loop unroll(full)``
(``JFM_PRAGMA_UNROLL``; ``Translator.check_fragment_loops``).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_DIR = os.path.join(HERE, "shim")

BUILTINS_3D = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
}
BUILTINS_1D = {
    "thread_index_in_threadgroup": "thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup": "threads_per_simdgroup",
    "thread_execution_width": "threads_per_simdgroup",
    "simdgroups_per_threadgroup": "simdgroups_per_threadgroup",
}
TYPES_3D = {"uint", "uint2", "uint3", "ushort", "ushort2", "ushort3"}
TYPES_1D = {"uint", "ushort"}
VECTOR_TYPES = {
    p + str(n)
    for p in ("float", "half", "bfloat", "int", "uint", "short", "ushort", "char", "uchar",
              "long", "ulong", "bool")
    for n in (2, 3, 4)
}

TOKEN_RE = re.compile(
    r"""(?P<ws>[ \t\r\n]+)
      |(?P<dir>(?<![^\n])[ \t]*\#[^\n]*)
      |(?P<str>"(?:\\.|[^"\\\n])*")
      |(?P<chr>'(?:\\.|[^'\\\n])+')
      |(?P<num>\.?[0-9](?:[eEpP][+-]|[0-9a-zA-Z_.]|'(?=[0-9a-zA-Z]))*)
      |(?P<id>[A-Za-z_][A-Za-z_0-9]*)
      |(?P<punct>::|->|\.\.\.|<<=|<=|>=|==|!=|&&|\|\||\+\+|--|\+=|-=|\*=|/=|%=|&=|\|=|\^=|<<|[^\s])
    """,
    re.VERBOSE,
)
LINE_MARKER_RE = re.compile(r'^\s*#\s*(?:line\s+)?(\d+)\s+"((?:\\.|[^"\\])*)"')
FLOAT_RE = re.compile(r"^((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)([fFhH]?)$")
SWIZZLE_RE = re.compile(r"^[xyzw]{2,4}$")  # (.rgba swizzles would clash with field names)
HEX_FLOAT_RE = re.compile(r"^(0[xX][0-9a-fA-F.]+[pP][+-]?[0-9]+)([fF]?)$")
# What JFM_PRAGMA_UNROLL (shaders/flash_attention_common.h) preprocesses to.
UNROLL_PRAGMA_RE = re.compile(r"(?m)^[ \t]*#[ \t]*pragma[ \t]+clang[ \t]+loop[ \t]+unroll[ \t]*\([ \t]*full[ \t]*\)")
FRAGMENT_TYPES = {"simdgroup_matrix"} | {f"simdgroup_{t}8x8" for t in ("float", "half", "bfloat")}
# Words before `name[` that make it an expression rather than a declaration.
NOT_TYPES = {"return", "else", "case", "do", "throw", "delete", "sizeof", "goto", "co_return"}


# Start of every translated file. JFM_STRICT: the strict pass. JFM_COUNTING: the counting build
# variant (compiled a second time with memory-access instrumentation, see README.md), whose shim
# and shader code live in namespace jfm_counting so they never merge with the normal build's
# inline functions and template instances; the shim's headers are included first, outside it.
HEADER = """#ifdef JFM_STRICT
#include "metal_strict.h"
#elif defined(JFM_COUNTING)
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include "runtime.h"
#define JFM_ROOT ::jfm_counting
namespace jfm_counting {
#include "metal_shim.h"
#else
#include "metal_shim.h"
#endif
"""


class TranslateError(Exception):
    pass


class Tok:
    __slots__ = ("kind", "text", "start", "end")

    def __init__(self, kind, text, start, end):
        self.kind, self.text, self.start, self.end = kind, text, start, end


class Source:
    """Preprocessed text, its tokens, and the mapping back to the original file:line."""

    def __init__(self, text):
        self.text = text
        self.toks = []
        self.markers = []  # (offset of the line after the marker, file, line number there)
        for m in TOKEN_RE.finditer(text):
            kind = m.lastgroup
            if kind == "ws":
                continue
            if kind == "dir":
                lm = LINE_MARKER_RE.match(m.group())
                if lm:
                    self.markers.append((m.end() + 1, lm.group(2), int(lm.group(1))))
                continue
            if kind == "punct" and m.group() == ">>":
                self.toks.append(Tok("punct", ">", m.start(), m.start() + 1))
                self.toks.append(Tok("punct", ">", m.start() + 1, m.end()))
                continue
            self.toks.append(Tok(kind, m.group(), m.start(), m.end()))

    def where(self, offset):
        file, line, base = "<input>", 1, 0
        for start, f, ln in self.markers:
            if start > offset:
                break
            file, line, base = f, ln, start
        return file, line + self.text.count("\n", base, offset)

    def error(self, tok_or_offset, message):
        offset = tok_or_offset.start if isinstance(tok_or_offset, Tok) else tok_or_offset
        file, line = self.where(offset)
        raise TranslateError(f"{file}:{line}: error: {message}")


class Param:
    def __init__(self, name, type_text, attrs, tok):
        self.name, self.type_text, self.attrs, self.tok = name, type_text, attrs, tok


class KernelDef:
    def __init__(self, name, template_params, template_names, params, max_threads, tok):
        self.name = name
        self.template_params = template_params  # text inside template <...>, or None
        self.template_names = template_names
        self.params = params
        self.max_threads = max_threads
        self.tok = tok


class Translator:
    def __init__(self, src):
        self.src = src
        self.toks = src.toks
        self.edits = []  # (start, end, replacement)
        self.attrs = {}  # token index of '[[' -> (index after ']]', [(name, arg text, tok)])
        self.kernels = {}
        self.instances = []  # (host name, kernel name, template args text, tok)
        self.function_constants = {}  # name -> (index, declaration's first and last token)
        self.match = self._match_brackets()
        self.fragment_types = self._fragment_types()

    # -- helpers ---------------------------------------------------------------------------------
    def _match_brackets(self):
        match, stack = {}, []
        pairs = {")": "(", "]": "[", "}": "{"}
        for i, t in enumerate(self.toks):
            if t.kind != "punct":
                continue
            if t.text in "([{":
                stack.append(i)
            elif t.text in ")]}":
                if not stack or self.toks[stack[-1]].text != pairs[t.text]:
                    self.src.error(t, f"unbalanced '{t.text}'")
                j = stack.pop()
                match[i], match[j] = j, i
        if stack:
            self.src.error(self.toks[stack[-1]], f"unbalanced '{self.toks[stack[-1]].text}'")
        return match

    def _fragment_types(self):
        """simdgroup_matrix spellings and the typedef/using names of one (e.g. JfmFrag)."""
        names, toks = set(FRAGMENT_TYPES), self.toks
        for i, t in enumerate(toks):
            if t.text not in ("typedef", "using"):
                continue
            semi = next((k for k in range(i + 1, len(toks)) if toks[k].text == ";"), len(toks))
            if not any(toks[k].text in names for k in range(i + 1, semi)):
                continue
            if t.text == "typedef" and toks[semi - 1].kind == "id":
                names.add(toks[semi - 1].text)
            elif t.text == "using" and i + 2 < semi and toks[i + 2].text == "=":
                names.add(toks[i + 1].text)
        return names

    def blank(self, i, j):
        """Replace tokens i..j-1 by spaces (newlines kept, so line numbers stay)."""
        start, end = self.toks[i].start, self.toks[j - 1].end
        self.edits.append((start, end, re.sub(r"[^\n]", " ", self.src.text[start:end])))

    def replace(self, i, j, text):
        start, end = self.toks[i].start, self.toks[j - 1].end
        self.edits.append((start, end, text + "\n" * self.src.text.count("\n", start, end)))

    def is_attr(self, i):
        return i in self.attrs

    def text_of(self, i, j):
        return " ".join(self.toks[k].text for k in range(i, j))

    def split_top(self, i, j, sep=","):
        """Split tokens i..j-1 at top-level separators (tracking () [] {} and <>)."""
        parts, start, angle, k = [], i, 0, i
        while k < j:
            t = self.toks[k]
            if t.text in "([{" and t.kind == "punct":
                k = self.match[k] + 1
                continue
            if t.text == "<":
                angle += 1
            elif t.text == ">" and angle:
                angle -= 1
            elif t.text == sep and angle == 0:
                parts.append((start, k))
                start = k + 1
            k += 1
        parts.append((start, j))
        return [p for p in parts if p[0] < p[1]]

    # -- passes ----------------------------------------------------------------------------------
    def run(self):
        self.collect_attributes()
        self.rewrite_literals_and_vectors()
        self.scan(0, len(self.toks))
        self.rewrite_function_constant_uses()
        out, pos = [], 0
        for start, end, repl in sorted(self.edits):
            if start < pos:
                raise TranslateError(f"internal error: overlapping rewrites at offset {start}")
            out.append(self.src.text[pos:start])
            out.append(repl)
            pos = end
        out.append(self.src.text[pos:])
        body = "".join(out)
        # GNU line markers -> #line (portable; keeps diagnostics pointing at the .metal file).
        def marker(m):
            if m.group(1) == "0" or m.group(2).startswith('"<'):
                return ""
            return f"#line {m.group(1)} {m.group(2)}"
        body = re.sub(r'(?m)^#\s+(\d+)\s+("(?:\\.|[^"\\])*")[^\n]*$', marker, body)
        return body

    def collect_attributes(self):
        toks, i = self.toks, 0
        while i + 1 < len(toks):
            if toks[i].text == "[" and toks[i + 1].text == "[" and toks[i + 1].start == toks[i].end:
                j = self.match[i]
                if toks[j - 1].text != "]" or self.match.get(i + 1) != j - 1:
                    self.src.error(toks[i], "malformed attribute")
                items = []
                for a, b in self.split_top(i + 2, j - 1):
                    name = toks[a].text
                    arg = None
                    if b - a > 1:
                        if toks[a + 1].text != "(" or self.match[a + 1] != b - 1:
                            self.src.error(toks[a], f"unsupported attribute '{self.text_of(a, b)}'")
                        arg = self.text_of(a + 2, b - 1)
                    items.append((name, arg, toks[a]))
                self.attrs[i] = (j + 1, items)
                self.blank(i, j + 1)
                i = j + 1
            else:
                i += 1

    def rewrite_literals_and_vectors(self):
        toks = self.toks
        for i, t in enumerate(toks):
            if t.kind == "num":
                m = FLOAT_RE.match(t.text)
                if m and ("." in m.group(1) or "e" in m.group(1).lower()):
                    if m.group(2) in ("h", "H"):
                        self.edits.append((t.start, t.end, f"half({m.group(1)}f)"))
                    elif not m.group(2):
                        self.edits.append((t.start, t.end, t.text + "f"))
                    continue
                m = HEX_FLOAT_RE.match(t.text)
                if m and not m.group(2):
                    self.edits.append((t.start, t.end, t.text + "f"))
            elif (t.kind == "id" and SWIZZLE_RE.match(t.text) and i > 0 and toks[i - 1].text == "."
                  and not (i + 1 < len(toks) and toks[i + 1].text == "(")):
                idx = ", ".join(str("xyzw".find(c)) for c in t.text)
                self.edits.append((t.start, t.end, f"JFM_SWIZZLE({t.text}, {idx})"))
            elif (t.kind == "id" and t.text in VECTOR_TYPES and i + 1 < len(toks)
                  and toks[i + 1].text == "(" and (i == 0 or toks[i - 1].text != "operator")):
                self.edits.append((t.start, t.end, f"jfm_make<{t.text}>"))

    def scan(self, lo, hi, in_namespace=False):
        """Walk declarations at namespace scope between token indices lo and hi."""
        self.in_namespace = in_namespace
        toks, i, start = self.toks, lo, lo
        while i < hi:
            t = toks[i]
            if self.is_attr(i):
                i = self.attrs[i][0]
                continue
            if t.text == ";":
                self.declaration(start, i, None)
                start = i = i + 1
                continue
            if t.text == "{":
                j = self.match[i]
                head = [k for k in range(start, i) if not self.is_attr(k)]
                head_text = [toks[k].text for k in head]
                if head_text and head_text[0] == "namespace":
                    self.scan(i + 1, j, True)
                    self.in_namespace = in_namespace
                    start = j + 1
                elif self.is_function_head(start, i):
                    self.declaration(start, i, (i, j))
                    start = j + 1
                i = j + 1
                continue
            if t.text in "([":
                i = self.match[i] + 1
                continue
            i += 1

    def is_function_head(self, lo, hi):
        k = lo
        while k < hi:
            if self.is_attr(k):
                k = self.attrs[k][0]
                continue
            t = self.toks[k].text
            if t in ("=", "struct", "class", "union", "enum"):
                return False
            if t == "(":
                return True
            k += 1
        return False

    def head_tokens(self, lo, hi):
        """Indices of non-attribute tokens, and the attributes outside parentheses, of a
        declaration head (attributes of parameters belong to the parameters)."""
        idx, attrs, k, close = [], [], lo, -1
        while k < hi:
            if self.is_attr(k):
                if k > close:
                    attrs.extend(self.attrs[k][1])
                k = self.attrs[k][0]
                continue
            if self.toks[k].text == "(" and k > close:
                close = self.match[k]
            idx.append(k)
            k += 1
        return idx, attrs

    def declaration(self, lo, hi, body):
        toks = self.toks
        idx, attrs = self.head_tokens(lo, hi)
        if any(name == "function_constant" for name, _, _ in attrs):
            self.function_constant(lo, hi, idx, attrs)
            return
        is_kernel = any(name == "kernel" for name, _, _ in attrs)
        for k in idx:
            if toks[k].text == "kernel":
                is_kernel = True
                self.blank(k, k + 1)
        if body:
            self.rewrite_threadgroup_decls(body[0] + 1, body[1], is_kernel)
            self.check_fragment_loops(idx, body[0] + 1, body[1])
        for name, arg, tok in attrs:
            if name not in ("kernel", "host_name", "max_total_threads_per_threadgroup"):
                self.src.error(tok, f"unsupported attribute '{name}' on a declaration")
        if not is_kernel:
            for name, _, tok in attrs:
                if name != "kernel":
                    self.src.error(tok, f"attribute '{name}' is only supported on kernels")
            return
        if not idx:
            return
        if self.in_namespace:
            self.src.error(toks[idx[0]], "kernels inside namespaces are not supported")
        host = [arg for name, arg, _ in attrs if name == "host_name"]
        max_threads = [arg for name, arg, _ in attrs if name == "max_total_threads_per_threadgroup"]
        first = toks[idx[0]]
        template_params = None
        if first.text == "template":
            if len(idx) > 1 and toks[idx[1]].text == "<":
                close = self.find_angle_close(idx[1], hi)
                template_params = (idx[1] + 1, close)
            else:
                self.instantiation(idx, host, first)
                return
        elif host:
            self.src.error(first, "[[host_name]] is only supported on explicit template instantiations")
        # Function name: the identifier before the parameter list.
        last = idx[-1]
        if toks[last].text != ")":
            self.src.error(first, "cannot parse kernel declaration")
        open_paren = self.match[last]
        name_tok = open_paren - 1
        if toks[name_tok].kind != "id":
            self.src.error(first, "cannot find the kernel's name")
        if body is None:
            return  # a forward declaration; the definition carries the parameters
        name = toks[name_tok].text
        if name in self.kernels:
            self.src.error(toks[name_tok], f"kernel '{name}' defined twice")
        tparams, tnames = None, None
        if template_params:
            a, b = template_params
            tparams = self.text_of(a, b)
            tnames = []
            for pa, pb in self.split_top(a, b):
                words = [toks[k] for k in range(pa, pb)]
                if any(w.text == "..." for w in words):
                    self.src.error(words[0], "variadic kernel templates are not supported")
                eq = next((n for n, w in enumerate(words) if w.text == "="), len(words))
                tnames.append(words[eq - 1].text)
        params = self.parse_params(open_paren + 1, last, name)
        self.kernels[name] = KernelDef(name, tparams, tnames, params,
                                       max_threads[0] if max_threads else None, toks[name_tok])

    def function_constant(self, lo, hi, idx, attrs):
        """`constant bool name [[function_constant(n)]];` at program scope: the declaration is
        removed and every later use of `name` reads the launch's value
        (JFM_FUNCTION_CONSTANT(bool, n), bound per launch by emu::Launch::function_constants)."""
        toks = self.toks
        words = [toks[k].text for k in idx]
        if self.in_namespace or function_constant_name(words) is None:
            self.src.error(toks[lo], "supported function constants: `constant bool name "
                           "[[function_constant(n)]];` at program scope")
        if len(attrs) != 1:
            self.src.error(attrs[0][2], "a function constant takes no other attribute")
        try:
            index = int(attrs[0][1], 0)
        except (TypeError, ValueError):
            self.src.error(attrs[0][2], "[[function_constant(n)]] needs an integer literal")
        if not 0 <= index < 32:
            self.src.error(attrs[0][2], f"function constant index {index} out of range 0..31")
        name = words[-1]
        if name in self.function_constants:
            self.src.error(toks[idx[-1]], f"function constant '{name}' declared twice")
        if index in {i for i, _ in self.function_constants.values()}:
            self.src.error(attrs[0][2], f"function constant index {index} used twice")
        self.function_constants[name] = (index, idx[-1])
        for k in idx + [hi]:  # (the attribute is blanked already)
            self.blank(k, k + 1)

    def rewrite_function_constant_uses(self):
        for k, t in enumerate(self.toks):
            entry = self.function_constants.get(t.text) if t.kind == "id" else None
            if entry is None or k == entry[1]:
                continue
            if k < entry[1]:
                self.src.error(t, f"function constant '{t.text}' used before its declaration")
            self.edits.append((t.start, t.end, f"JFM_FUNCTION_CONSTANT(bool, {entry[0]})"))

    def find_angle_close(self, i, hi):
        depth, k = 0, i
        while k < hi:
            t = self.toks[k].text
            if t in "([{" and self.toks[k].kind == "punct":
                k = self.match[k] + 1
                continue
            if t == "<":
                depth += 1
            elif t == ">":
                depth -= 1
                if depth == 0:
                    return k
            k += 1
        self.src.error(self.toks[i], "unbalanced '<'")

    def instantiation(self, idx, host, tok):
        """template [[host_name("x")]] kernel void f<args>(...); or ... decltype(f<args>) f<args>;"""
        toks = self.toks
        if not host:
            self.src.error(tok, "explicit kernel instantiation needs [[host_name(\"...\")]]")
        name = host[0].strip()
        if not (name.startswith('"') and name.endswith('"')):
            self.src.error(tok, "host_name needs a string literal")
        name = name[1:-1]
        end = len(idx)
        if toks[idx[-1]].text == ")":  # parameter list: drop it
            open_paren = self.match[idx[-1]]
            end = next(n for n, k in enumerate(idx) if k == open_paren)
        if end == 0 or toks[idx[end - 1]].text != ">":
            self.src.error(tok, "explicit instantiation must name template arguments: f<...>")
        close = idx[end - 1]
        depth, k = 0, close
        while True:
            t = toks[k].text
            if t == ">":
                depth += 1
            elif t == "<":
                depth -= 1
                if depth == 0:
                    break
            elif t in ")]}":
                k = self.match[k]
            k -= 1
        fname = toks[k - 1].text
        self.instances.append((name, fname, self.text_of(k + 1, close), tok))

    def parse_params(self, lo, hi, kname):
        toks, params = self.toks, []
        for a, b in self.split_top(lo, hi):
            idx, attrs = self.head_tokens(a, b)
            words = [toks[k] for k in idx]
            if not words:
                continue
            if any(w.text == "=" for w in words):
                self.src.error(words[0], "default arguments on kernel parameters are not supported")
            name_pos = max(n for n, w in enumerate(words) if w.kind == "id")
            name = words[name_pos].text
            type_text = " ".join(w.text for w in words[:name_pos])
            if name_pos == 0 or words[name_pos - 1].text in (",", "("):
                self.src.error(words[0], f"kernel '{kname}': parameter needs a name")
            params.append(Param(name, type_text, attrs, words[0]))
        return params

    # -- fragment loops -----------------------------------------------------------------------
    def fragment_arrays(self, head, lo, hi):
        """Names of the fragment arrays of a function (emulator/README.md, "Strict pass"):
        parameters `thread F* x` with F a simdgroup_matrix type and array references `(&x)[N]`;
        locals `T x[N]` of the thread address space (not threadgroup, constant, device or
        static). `head`: the declaration head's token indices; lo..hi: the body's tokens."""
        toks, names = self.toks, set()
        close = next((k for k in reversed(head) if toks[k].text == ")"), None)
        if close is not None:
            for a, b in self.split_top(self.match[close] + 1, close):
                words = [toks[k].text for k in range(a, b)]
                ids = [toks[k].text for k in range(a, b) if toks[k].kind == "id"]
                if "*" in words and self.fragment_types & set(words) and ids:
                    names.add(ids[-1])
                elif words[-1:] == ["]"] and "&" in words and ids:
                    names.add(toks[words.index("&") + a + 1].text)
        for k in range(lo + 1, hi - 1):
            t, prev = toks[k], toks[k - 1]
            if t.kind != "id" or toks[k + 1].text != "[":
                continue
            if prev.text == ">":  # simdgroup_matrix<float, 8, 8> x[N]
                opened, depth = k - 1, 0
                while opened > lo:
                    depth += {">": 1, "<": -1}.get(toks[opened].text, 0)
                    if depth == 0:
                        break
                    opened -= 1
                prev = toks[opened - 1]
            if prev.kind != "id" or prev.text in NOT_TYPES:
                continue
            after = self.match[k + 1] + 1
            if toks[after].text not in (";", ",", "=", "[", "{"):
                continue
            start = k
            while start > lo and toks[start - 1].text not in (";", "{", "}", "(", ")"):
                start -= 1
            if not {"threadgroup", "constant", "device", "static"} & {
                    toks[n].text for n in range(start, k)}:
                names.add(t.text)
        return names

    def loop_statement_end(self, k):
        """Index after the statement starting at token k (a block, or up to its `;`)."""
        if self.toks[k].text == "{":
            return self.match[k] + 1
        while self.toks[k].text != ";":
            k = self.match[k] + 1 if self.toks[k].text in "([{" and self.toks[k].kind == "punct" \
                else k + 1
        return k + 1

    def check_fragment_loops(self, head, lo, hi):
        """A `for` loop whose body subscripts a fragment array, or a fragment's
        `thread_elements()`, with an expression naming the loop variable must carry
        JFM_PRAGMA_UNROLL: kept rolled by the GPU compiler, the array would be indexed at run time
        and live in stack memory instead of registers."""
        toks = self.toks
        arrays = self.fragment_arrays(head, lo, hi)
        for i in range(lo, hi):
            if toks[i].text != "for" or toks[i + 1].text != "(":
                continue
            close = self.match[i + 1]
            init = self.split_top(i + 2, close, ";")[0] if close > i + 2 else (i + 2, i + 2)
            eq = next((k for k in range(*init) if toks[k].text in ("=", ":")), init[1])
            if eq == init[0] or toks[eq - 1].kind != "id":
                continue
            var = toks[eq - 1].text
            end = self.loop_statement_end(close + 1)
            for b in range(close + 1, end):
                if toks[b].text != "[" or toks[b].kind != "punct":
                    continue
                array = toks[b - 1].text
                elements = array == ")" and toks[b - 2].text == "(" and \
                    toks[b - 3].text == "thread_elements"
                member = toks[b - 2].text in (".", "->")
                if not (elements or (array in arrays and not member)):
                    continue
                if not any(toks[n].text == var for n in range(b + 1, self.match[b])):
                    continue
                gap = self.src.text[toks[i - 1].end:toks[i].start]
                if not UNROLL_PRAGMA_RE.search(gap):
                    what = "a fragment's thread_elements()" if elements else \
                        f"fragment array '{array}'"
                    self.src.error(toks[i], f"loop over '{var}' indexes {what} with it but has no "
                                   "JFM_PRAGMA_UNROLL (_Pragma(\"clang loop unroll(full)\")) "
                                   "before it: a rolled loop keeps the array in stack memory")
                break

    def rewrite_threadgroup_decls(self, lo, hi, in_kernel):
        toks, k = self.toks, lo
        while k < hi:
            t = toks[k]
            if t.text != "threadgroup":
                k += 1
                continue
            first = k
            prev = toks[k - 1].text if k > 0 else ";"
            if prev == "static":
                first = k - 1
                prev = toks[k - 2].text
            semi = k + 1
            while semi < hi and toks[semi].text != ";":
                if toks[semi].text in "([{" and toks[semi].kind == "punct":
                    semi = self.match[semi]
                semi += 1
            decls = self.split_top(k + 1, semi)
            a, b = decls[0]
            # Pointers and references to threadgroup memory are ordinary locals.
            top = []
            n = a
            while n < b:
                top.append(toks[n].text)
                n = self.match[n] + 1 if toks[n].text in "([{" and toks[n].kind == "punct" else n + 1
            if any(x in ("*", "&", "&&", "(", ")") for x in top):
                k += 1
                continue
            if prev not in ("{", "}", ";", ":"):
                # A threadgroup variable where the rewrite cannot place a statement: refuse rather
                # than leave a per-thread local.
                self.src.error(t, "unsupported placement of a threadgroup variable declaration")
            if not in_kernel:
                self.src.error(t, "threadgroup variables can only be declared in kernel functions")
            out = []
            type_text = None
            for da, db in decls:
                if any(toks[n].text == "=" for n in range(da, db)):
                    self.src.error(toks[da], "threadgroup variables cannot have initializers")
                bracket = next((n for n in range(da, db) if toks[n].text == "["), db)
                name_tok = toks[bracket - 1]
                if name_tok.kind != "id":
                    self.src.error(name_tok, "cannot parse threadgroup declaration")
                if type_text is None:
                    type_text = self.text_of(da, bracket - 1)
                    if not type_text:
                        self.src.error(name_tok, "threadgroup declaration without a type")
                dims = self.text_of(bracket, db)
                out.append(f"JFM_TGV({name_tok.text}, {dims}, {type_text})")
            self.replace(first, semi, "; ".join(out))
            k = semi

    # -- output ----------------------------------------------------------------------------------
    def launchers(self, stem, file_label):
        lines, entries = [], []
        by_name = {}
        for name, fname, targs, tok in self.instances:
            k = self.kernels.get(fname)
            if k is None or k.template_params is None:
                self.src.error(tok, f"'{fname}' is not a template kernel defined in this file")
            by_name.setdefault(name, []).append(tok)
            entries.append((name, k, targs))
        for k in self.kernels.values():
            if k.template_params is None:
                by_name.setdefault(k.name, []).append(k.tok)
                entries.append((k.name, k, None))
        for name, toks in by_name.items():
            if len(toks) > 1:
                self.src.error(toks[1], f"kernel name '{name}' is defined twice")
        for k in self.kernels.values():
            args, bufs = [], []
            used = {}
            for p in k.params:
                if not p.attrs:
                    self.src.error(p.tok, f"kernel '{k.name}': parameter '{p.name}' needs a "
                                   "[[buffer(n)]] or builtin attribute")
                if len(p.attrs) > 1:
                    self.src.error(p.tok, f"kernel '{k.name}': parameter '{p.name}' has several attributes")
                attr, arg, atok = p.attrs[0]
                plain = " ".join(w for w in p.type_text.split() if w != "const")
                if attr == "buffer":
                    try:
                        index = int(arg, 0)
                    except (TypeError, ValueError):
                        self.src.error(atok, "[[buffer(n)]] needs an integer literal")
                    if not 0 <= index < 31:
                        self.src.error(atok, f"buffer index {index} out of range 0..30")
                    if index in used:
                        self.src.error(atok, f"buffer index {index} bound twice ('{used[index]}')")
                    used[index] = p.name
                    words = p.type_text.split()
                    if "device" not in words and "constant" not in words:
                        self.src.error(p.tok, f"buffer parameter '{p.name}' needs the device or "
                                       "constant address space")
                    space = "true" if "constant" in words else "false"
                    if p.type_text.endswith("*"):
                        args.append(f"static_cast<{p.type_text}>(c.buffers[{index}])")
                        bufs.append(f"{{{index}, 0, {space}, \"{p.name}\"}}")
                    elif p.type_text.endswith("&"):
                        pointee = p.type_text[:-1].strip()
                        args.append(f"*static_cast<{pointee}*>(c.buffers[{index}])")
                        bufs.append(f"{{{index}, sizeof({pointee}), {space}, \"{p.name}\"}}")
                    else:
                        self.src.error(p.tok, f"buffer parameter '{p.name}' must be a pointer or reference")
                elif attr in BUILTINS_3D:
                    if plain not in TYPES_3D:
                        self.src.error(p.tok, f"[[{attr}]] needs one of {sorted(TYPES_3D)}, not '{p.type_text}'")
                    args.append(f"JFM_ROOT::jfm::rt::builtin<{plain}>(c.{attr})")
                elif attr in BUILTINS_1D:
                    if plain not in TYPES_1D:
                        self.src.error(p.tok, f"[[{attr}]] needs uint or ushort, not '{p.type_text}'")
                    args.append(f"JFM_ROOT::jfm::rt::builtin<{plain}>(c.{BUILTINS_1D[attr]})")
                elif attr == "threadgroup":
                    self.src.error(atok, "[[threadgroup(n)]] arguments are not supported: declare "
                                   "threadgroup memory statically in the kernel body")
                else:
                    self.src.error(atok, f"unsupported kernel parameter attribute '{attr}'")
            call = k.name + (f"<{', '.join(k.template_names)}>" if k.template_names else "")
            if not bufs:
                bufs.append('{-1, 0, false, ""}')
            k.num_buffers = len(used)
            lines.append(f"template <{k.template_params}>" if k.template_params is not None else "")
            lines.append(f"struct jfm_kernel_{k.name} {{")
            lines.append("  static void launch(const ::jfm::rt::ThreadCtx& c) {")
            lines.append(f"    {call}({', '.join(args)});")
            lines.append("  }")
            lines.append("  static const ::jfm::rt::BufferUse* buffers() {")
            lines.append(f"    static const ::jfm::rt::BufferUse b[] = {{{', '.join(bufs)}}};")
            lines.append("    return b;")
            lines.append("  };")
            # Inside the (template) struct, so the bound may depend on the template parameters.
            mt = f"uint32_t({k.max_threads})" if k.max_threads else "0"
            lines.append(f"  static constexpr uint32_t max_threads = {mt};")
            lines.append("};")
        table = []
        for name, k, targs in entries:
            t = f"jfm_kernel_{k.name}" + (f"<{targs}>" if targs is not None else "")
            file, line = self.src.where(k.tok.start)
            table.append(f'  {{"{name}", &{t}::launch, &{t}::buffers, {k.num_buffers}, '
                         f'{t}::max_threads, "{file_label}", {line}}},')
        # Launcher code is not shader code: its line information must not name the .metal file
        # (the sanitizer's reports list the shader lines of an access).
        out = ["", "#ifndef JFM_STRICT", "// ---- launchers (generated) ----",
               f'#line 1 "{stem} launchers (generated)"', "namespace {"]
        out += lines
        if table:
            out.append("const ::jfm::rt::KernelDef jfm_defs[] = {")
            out += table
            out.append("};")
        out.append("}  // namespace")
        defs = "jfm_defs" if table else "nullptr"
        out.append("#ifdef JFM_COUNTING")
        out.append("}  // namespace jfm_counting")
        out.append("namespace jfm { namespace rt {")
        out.append(f"extern const KernelTable jfm_counting_table_{stem};")
        out.append(f"const KernelTable jfm_counting_table_{stem} = "
                   f"{{{'jfm_counting::' + defs if table else defs}, {len(table)}}};")
        out.append("} }  // namespace jfm::rt")
        out.append("#else")
        out.append("namespace jfm { namespace rt {")
        out.append(f"extern const KernelTable jfm_table_{stem};")
        out.append(f"const KernelTable jfm_table_{stem} = {{{defs}, {len(table)}}};")
        out.append("} }  // namespace jfm::rt")
        out.append("#endif  // JFM_COUNTING")
        out.append("#endif  // JFM_STRICT")
        return "\n".join(out) + "\n", [name for name, _, _ in entries]


def function_constant_name(words):
    """The name of `constant bool name` (a function constant's declaration), else None."""
    return words[2] if words[:2] == ["constant", "bool"] and len(words) == 3 else None


def preprocess(cxx, path):
    """Runs the C preprocessor of compiler `cxx` (a path, or a ;-list with a launcher) on `path`
    with __METAL_VERSION__=300 and the empty <metal_*> headers of shim/stdinc. Returns the text
    with line markers; raises TranslateError with the compiler's message on failure."""
    cmd = [*cxx.split(";"), "-E", "-x", "c++", "-std=c++14", "-undef", "-nostdinc",
           "-D__METAL_VERSION__=300", "-isystem", os.path.join(SHIM_DIR, "stdinc"), path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise TranslateError(r.stderr.strip() or f"preprocessor failed: {' '.join(cmd)}")
    return r.stdout


def translate(input_path, output_path, stem, cxx):
    """Translates one .metal file into `output_path` (C++) and `output_path`.kernels (names).
    Returns the kernel names; raises TranslateError naming file:line for unsupported input."""
    src = Source(preprocess(cxx, os.path.abspath(input_path)))
    tr = Translator(src)
    body = tr.run()
    launchers, names = tr.launchers(stem, os.path.basename(input_path))
    header = (f"// Generated by emulator/translate.py from {os.path.basename(input_path)}; "
              "do not edit.\n" + HEADER)
    with open(output_path, "w") as f:
        f.write(header + body + launchers)
    with open(output_path + ".kernels", "w") as f:
        f.write("".join(n + "\n" for n in names))
    return names


def table_list(function, prefix, stems):
    """C++ lines of `const KernelTable* function(int* count)` returning tables prefix + stem."""
    lines = [f"extern const KernelTable {prefix}{s};" for s in stems]
    lines.append(f"const KernelTable* {function}(int* count) {{")
    if stems:
        lines.append(f"  static const KernelTable* const tables[] = {{{', '.join('&' + prefix + s for s in stems)}}};")
        lines.append(f"  static KernelTable copy[{len(stems)}];")
        lines.append(f"  for (int i = 0; i < {len(stems)}; ++i) copy[i] = *tables[i];")
        lines.append(f"  *count = {len(stems)};")
        lines.append("  return copy;")
    else:
        lines.append("  *count = 0;")
        lines.append("  return nullptr;")
    lines.append("}")
    return lines


def write_registry(output, kernel_lists, counting):
    """Writes the C++ list of all kernel tables, and of the counting variants' tables when
    `counting` (else that list is empty), rewritten only when it changes; raises TranslateError
    if two shader files define the same kernel name."""
    seen, stems = {}, []
    for path in kernel_lists:
        stem = os.path.basename(path)[: -len(".cc.kernels")]
        stems.append(stem)
        with open(path) as f:
            for name in f.read().split():
                if name in seen:
                    raise TranslateError(f"kernel '{name}' is defined in both {seen[name]} and {stem}")
                seen[name] = stem
    lines = ["// Generated by emulator/translate.py: the kernel tables of all translated shaders.",
             '#include "runtime.h"', "namespace jfm { namespace rt {"]
    lines += table_list("all_kernel_tables", "jfm_table_", stems)
    lines += table_list("all_counting_kernel_tables", "jfm_counting_table_",
                        stems if counting else [])
    lines.append("} }  // namespace jfm::rt")
    content = "\n".join(lines) + "\n"
    if not os.path.exists(output) or open(output).read() != content:
        with open(output, "w") as f:
            f.write(content)


def strict_command(clang, path):
    """The clang command line of the strict pass on translated file `path`."""
    return [clang, "-fsyntax-only", "-x", "c++", "-std=c++14", "-target", "aarch64-linux-gnu",
            "-march=armv8.6-a+bf16", "-nostdinc", "-DJFM_STRICT", "-I", SHIM_DIR, "-Werror=c++17-extensions",
            "-Werror=c++20-extensions", "-Wno-unused-value", path]


def strict(clang, path):
    """Runs the strict pass; raises TranslateError with clang's diagnostics on failure."""
    r = subprocess.run(strict_command(clang, path), capture_output=True, text=True)
    if r.returncode != 0:
        raise TranslateError("strict pass failed:\n" + r.stderr.strip())


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("shader")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--stem", required=True)
    p.add_argument("--cxx", required=True)
    p = sub.add_parser("registry")
    p.add_argument("--output", required=True)
    p.add_argument("--counting", action="store_true",
                   help="the counting build variants are compiled too (JFM_COUNTING)")
    p.add_argument("lists", nargs="*")
    p = sub.add_parser("strict")
    p.add_argument("--input", required=True)
    p.add_argument("--clang", required=True)
    p.add_argument("--stamp")
    p = sub.add_parser("check")
    p.add_argument("--input", required=True)
    p.add_argument("--cxx", required=True)
    p.add_argument("--clang", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "shader":
            translate(args.input, args.output, args.stem, args.cxx)
        elif args.cmd == "registry":
            write_registry(args.output, args.lists, args.counting)
        elif args.cmd == "strict":
            strict(args.clang, args.input)
            if args.stamp:
                open(args.stamp, "w").close()
        elif args.cmd == "check":
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "check.cc")
                translate(args.input, out, "check", args.cxx)
                strict(args.clang, out)
    except TranslateError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
