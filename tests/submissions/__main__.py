import sys

from . import build

if len(sys.argv) < 2:
    sys.exit("usage: python -m tests.submissions DEST [LESSON ...]")
for lesson, students in build(sys.argv[1], sys.argv[2:] or None).items():
    print(f"{lesson}: {', '.join(s.id for s in students)}")
