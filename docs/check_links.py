"""Checks relative links (and their #anchors) in README.md, docs/*.md, benchmarks/*.md.

  python3 docs/check_links.py [REPO_ROOT]

Anchors are GitHub's heading slugs plus explicit <a id="..."> tags. A figure linked to a row of
benchmarks/RESULTS.md (``[1.64x](...RESULTS.md#row)``, ``[25.03 ms](...)``, ``[0.93x](...)``)
must appear in that row: the table is rebuilt from each case's latest run, and a figure quoted
from an earlier run goes stale unnoticed. (A figure of the past links to the performance
history instead.) Exits 1 on a broken link or a stale figure.
"""
import functools, glob, os, re, sys
from urllib.parse import unquote

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."
files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) \
    + sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.md")))

def strip_code(text):
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  return re.sub(r"`[^`\n]*`", "", text)

@functools.lru_cache(maxsize=None)  # one parse per file, not per link
def anchors(path):
  text = open(path).read()
  out, seen = set(), {}
  for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
    m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      h = re.sub(r"<[^>]+>", "", m.group(1))
      h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)   # link text only
      s = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
      n = seen.get(s, 0); seen[s] = n + 1
      out.add(s if n == 0 else f"{s}-{n}")
  out |= set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
  return out

def result_rows(path):
  """RESULTS.md's table rows by their <a id> anchor."""
  rows = {}
  for line in open(path).read().splitlines():
    m = re.match(r'\| <a id="([^"]+)"></a>', line)
    if m:
      rows[m.group(1)] = line
  return rows

RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
rows = result_rows(RESULTS) if os.path.exists(RESULTS) else {}
# A link whose text is a figure (a ratio, a time, a percentage, a plain number).
FIGURE = re.compile(r"\[([0-9][0-9.,]*(?:x| ms| µs| s| GiB|%)?)\]\(([^)\s]*RESULTS\.md)#([\w-]+)\)")

bad = 0
for f in files:
  text = strip_code(open(f).read())
  for m in re.finditer(r"\]\(([^)\s]+)\)", text):
    target = m.group(1)
    if re.match(r"[a-z]+:", target):
      continue
    path, _, frag = target.partition("#")
    dest = os.path.normpath(os.path.join(os.path.dirname(f), unquote(path))) if path else f
    if not os.path.exists(dest):
      print(f"{os.path.relpath(f, ROOT)}: missing {target}"); bad += 1; continue
    if frag and dest.endswith(".md") and frag not in anchors(dest):
      print(f"{os.path.relpath(f, ROOT)}: no anchor #{frag} in {os.path.relpath(dest, ROOT)}"); bad += 1
  for m in FIGURE.finditer(text):
    value, path, frag = m.groups()
    dest = os.path.normpath(os.path.join(os.path.dirname(f), unquote(path)))
    if dest != os.path.normpath(RESULTS) or frag not in rows:
      continue  # a missing row is reported above
    # A cell holding the figure: the number, its "x" or "%", then the cell's end or a space
    # (a loss cell goes on with "± ..."). The table's times carry no unit.
    cell = re.compile(re.escape(re.match(r"[0-9][0-9.,]*", value).group(0)) + r"[x%]?(\s|$)")
    if not any(cell.match(c.strip()) for c in rows[frag].split("|")):
      print(f"{os.path.relpath(f, ROOT)}: {value} is not in RESULTS.md's row #{frag}")
      bad += 1
print(f"{len(files)} files, {bad} broken links or stale figures")
sys.exit(1 if bad else 0)
