#!/usr/bin/env python3
"""Pairs of source files of one crate that import each other (step 11: no such pair is left).

A file refers to a module through `crate::a::b` or `super::x` paths outside comments and its
`#[cfg(test)] mod tests`; a pair is two files each referring to the other's module, leaving out a
module and its own descendants (a parent declares its children, and they use its items). Exits 1
when a pair is found, so ./farm check fails on a new one. Usage: import_pairs.py [REPO_ROOT]"""
import os, re, sys, itertools
root = sys.argv[1] if len(sys.argv) > 1 else '.'
crates = []
for dp, dn, fn in os.walk(root):
    if 'target' in dp or '/.git' in dp: continue
    if 'Cargo.toml' in fn and os.path.isdir(os.path.join(dp, 'src')):
        crates.append(os.path.join(dp, 'src'))
pairs = []
for src in crates:
    mods = {}  # module path tuple -> file
    for dp, dn, fn in os.walk(src):
        for f in fn:
            if not f.endswith('.rs'): continue
            rel = os.path.relpath(os.path.join(dp, f), src)[:-3].split(os.sep)
            if rel[-1] in ('mod',): rel = rel[:-1]
            if rel in (['lib'], ['main']): rel = []
            if rel and rel[0] == 'bin': continue
            mods[tuple(rel)] = os.path.join(dp, f)
    refs = {m: set() for m in mods}
    for m, path in mods.items():
        text = open(path).read()
        text = re.split(r'#\[cfg\(test\)\]\s*mod tests', text)[0]
        text = re.sub(r'//.*', '', text)  # doc links are not imports
        for mm in re.finditer(r'crate::((?:\w+::)*\w+)', text):
            parts = tuple(mm.group(1).split('::'))
            for k in range(len(parts), 0, -1):
                if parts[:k] in mods: refs[m].add(parts[:k]); break
        parent = m[:-1] if path.endswith('mod.rs') is False else m[:-1]
        for mm in re.finditer(r'\bsuper::((?:\w+::)*\w+)', text):
            parts = parent + tuple(mm.group(1).split('::'))
            for k in range(len(parts), len(parent), -1):
                if parts[:k] in mods: refs[m].add(parts[:k]); break
        # use from a file's own children/siblings via `self::`
    for a, b in itertools.combinations(mods, 2):
        if not a or not b or a == b[:len(a)] or b == a[:len(b)]: continue
        def hits(x, y):
            return y in refs[x]
        if hits(a, b) and hits(b, a):
            pairs.append((os.path.relpath(mods[a], root), os.path.relpath(mods[b], root)))
for p in pairs: print(' <-> '.join(p))
print(len(pairs), 'file pairs importing each other (ancestor/descendant pairs left out)')
sys.exit(1 if pairs else 0)
