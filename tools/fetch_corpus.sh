#!/usr/bin/env bash
# Builds the English corpus for tools/train_tiny_lm.py from two Debian packages:
#   linux-doc-6.1  kernel Documentation/**/*.rst and *.txt, translations/ excluded (GPL-2.0, some GFDL-1.1)
#   dict-gcide     GNU Collaborative International Dictionary of English (Webster 1913 + WordNet, GPL-2+)
# and writes ONE xz file of NUL-separated UTF-8 documents (default .corpus/english.txt.xz,
# relative to the current directory). Runs on a Debian machine with apt (no GPU, no Python
# packages beyond the standard library).
#
# Documents: one per linux-doc file (files under 200 bytes dropped); the dictionary's body is
# cut at entry boundaries into documents of about 16 KB (its 00-database-* header entries are
# dropped). Order: linux-doc files by sorted path, then the dictionary in its own order; the
# training script shuffles with a fixed seed. Prints the package versions and the sha256 of
# the .deb files, and the size of the result (must be <= 25 MB).
#
# usage: tools/fetch_corpus.sh [OUT.txt.xz]
set -euo pipefail
out="${1:-.corpus/english.txt.xz}"
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
apt-get download linux-doc-6.1 dict-gcide >/dev/null 2>&1 || apt-get download linux-doc-6.1 dict-gcide
for deb in linux-doc-6.1_*.deb dict-gcide_*.deb; do
  echo "package $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) sha256 $(sha256sum "$deb" | cut -d' ' -f1) $deb"
  dpkg-deb -x "$deb" x
done
python3 - "$tmp/x" "$tmp/english.txt" <<'EOF'
import gzip, os, sys
root, dst = sys.argv[1], sys.argv[2]
docs = []
ldoc = os.path.join(root, "usr/share/doc/linux-doc-6.1/Documentation")
paths = []
for dp, dns, fns in os.walk(ldoc):
    rel = os.path.relpath(dp, ldoc)
    if rel == "translations" or rel.startswith("translations" + os.sep):
        continue
    for fn in fns:
        base = fn[:-3] if fn.endswith(".gz") else fn
        if base.endswith(".rst") or base.endswith(".txt"):
            paths.append(os.path.join(dp, fn))
paths.sort()
n_l = 0
for p in paths:
    raw = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
    t = raw.decode("utf-8", errors="replace").replace("\0", "").replace("\r\n", "\n")
    if len(t.strip()) < 200:
        continue
    docs.append(t.strip() + "\n"); n_l += 1
b_l = sum(len(d.encode()) for d in docs)
# dict-gcide: dictd format, entries separated by blank lines, headword lines start at column 0.
text = gzip.open(os.path.join(root, "usr/share/dictd/gcide.dict.dz")).read().decode("utf-8", errors="replace")
text = text.replace("\0", "").replace("\r\n", "\n")
entries, cur = [], []
for line in text.split("\n"):
    if line and not line[0].isspace() and (not cur or cur[-1] == ""):
        if cur:
            entries.append("\n".join(cur).strip())
        cur = [line]
    else:
        cur.append(line)
if cur:
    entries.append("\n".join(cur).strip())
entries = [e for e in entries if e and not e.startswith("00-database")]
# the license/preface blocks of each letter file are not entries with a headword \..\; keep
# only blocks whose first line carries a pronunciation-style headword "word \word\"
entries = [e for e in entries if "\\" in e.split("\n", 1)[0]]
n_g, chunk, size = 0, [], 0
for e in entries:
    chunk.append(e); size += len(e) + 2
    if size >= 16384:
        docs.append("\n\n".join(chunk) + "\n"); n_g += 1; chunk, size = [], 0
if chunk:
    docs.append("\n\n".join(chunk) + "\n"); n_g += 1
b_g = sum(len(d.encode()) for d in docs) - b_l
with open(dst, "w", encoding="utf-8") as f:
    f.write("\0".join(docs))
print(f"linux-doc: {n_l} docs {b_l} bytes; gcide: {len(entries)} entries in {n_g} docs {b_g} bytes;"
      f" total {len(docs)} docs {b_l + b_g} bytes")
EOF
xz -9e -T1 -c english.txt > "$out"
echo "wrote $out: $(stat -c %s "$out") bytes (xz), sha256 $(sha256sum "$out" | cut -d' ' -f1)"
[ "$(stat -c %s "$out")" -le 25000000 ] || { echo "ERROR: corpus larger than 25 MB" >&2; exit 1; }
