#!/usr/bin/env python3
"""PTX of kvq_gpu's CUDA sources, and a kernel-by-kernel comparison of two PTX files.

  ptx_diff.py emit BUILD OUT         nvcc -ptx (compute_90, no -lineinfo) of every gpu/src/*.cu in
                                     BUILD's compile_commands.json (configure with
                                     -DCMAKE_EXPORT_COMPILE_COMMANDS=ON), into OUT/<file>.ptx
  ptx_diff.py compare OLD NEW [A=B]  per kernel: IDENTICAL; LITERALS-ONLY (every differing line a
                                     1:1 replacement differing only in integers: parameter
                                     offsets, inline-asm label numbers); or DIFF with counts.
                                     Names are compared without anonymous-namespace and internal
                                     symbol hashes; A=B renames a kernel-name fragment of OLD.
Used to check that a structural change leaves the kernels' generated code as it was.
"""
import difflib
import json
import os
import re
import subprocess
import sys


def emit(build, out):
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    procs = []
    for e in json.load(open(os.path.join(build, 'compile_commands.json'))):
        f = e['file']
        if '/gpu/src/' not in f or not f.endswith('.cu'):
            continue
        cmd = e['command'].replace(' -lineinfo', '')
        cmd = re.sub(r'--generate-code=arch=compute_90,code=\[compute_90,sm_90\]', '-arch=compute_90', cmd)
        cmd = re.sub(r' -c (\S+) -o \S+', r' -ptx \1 -o ' + os.path.join(out, os.path.basename(f) + '.ptx'), cmd)
        procs.append((f, subprocess.Popen(cmd, shell=True, cwd=e['directory'])))
        if len(procs) >= 2:
            f0, p0 = procs.pop(0)
            print(f0, p0.wait())
    for f, p in procs:
        print(f, p.wait())


def entries(path):
    txt = open(path).read()
    out = {}
    for m in re.finditer(r'^(?:\.visible |\.weak )?\.entry (\S+)\(', txt, re.M):
        start = m.start()
        out[m.group(1)] = txt[start:txt.find('\n}\n', start)]
    return out


def canon(name):
    name = re.sub(r'NS[12]_9QuantLoop', 'QL', name)
    m = re.search(r'(\d+)(_GLOBAL__N__)', name)
    if m:
        name = name[:m.start()] + 'ANON' + name[m.start(2) + int(m.group(1)):]
    return name


def lines(body, name):
    body = body.replace(name, 'KERNEL')
    body = re.sub(r'\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}', 'ANONNS', body)
    body = re.sub(r'_ZZN\d+_INTERNAL_\w+?(RotateQuery|MergeHeads)', r'_ZZN_INTERNAL_\1', body)
    return [l for l in body.split('\n') if not re.match(r'\s*\.loc\s', l)]


def compare(old, new, renames):
    strip = lambda l: re.sub(r'\d+', '#', l)
    o = {canon(k): (k, v) for k, v in entries(old).items()}
    n = {canon(k): (k, v) for k, v in entries(new).items()}
    for a, b in renames.items():
        for key in list(o):
            if a in key:
                o[key.replace(a, b)] = o.pop(key)
    for key in sorted(set(o) | set(n)):
        if key not in o or key not in n:
            print('ONLY IN', 'old' if key in o else 'new', key)
            continue
        a = lines(o[key][1], o[key][0])
        b = lines(n[key][1], n[key][0])
        literal = other = 0
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if tag == 'equal':
                continue
            if tag == 'replace' and i2 - i1 == j2 - j1 and all(
                    strip(a[i]) == strip(b[j1 + i - i1]) for i in range(i1, i2)):
                literal += i2 - i1
            else:
                other += max(i2 - i1, j2 - j1)
        if literal == other == 0:
            verdict = 'IDENTICAL'
        elif other == 0:
            verdict = 'LITERALS-ONLY (%d lines)' % literal
        else:
            verdict = 'DIFF (%d literal, %d other lines; %d vs %d lines)' % (literal, other, len(a), len(b))
        print(verdict, key)


if __name__ == '__main__':
    if len(sys.argv) >= 4 and sys.argv[1] == 'emit':
        emit(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == 'compare':
        compare(sys.argv[2], sys.argv[3], dict(a.split('=', 1) for a in sys.argv[4:]))
    else:
        sys.exit(__doc__)
