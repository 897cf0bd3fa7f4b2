"""Count the asserts in tests/ that check wording: an assert is a wording assert when it
(a) searches a string literal in something: `'x' in s` / `'x' not in s` (the literal, or an f-string, on the left;
    not when the right is a literal or built collection, a membership test of a name: `'a/b' in [leaf.name ...]`),
(b) calls .startswith / .endswith / .count / .index / .find / re.search / re.match / re.fullmatch / re.findall
    with a string literal or f-string argument (not a leaf path or its prefix: `'first_step/grads/'`), or
(c) compares (== / !=) with a string literal that holds a space (a sentence or a fragment of one).
Labels compared whole (`kind == 'ema'`) are not counted. Usage: python tests/count_wording.py [tests_dir] [-v]
Files of report/'s own tests (test_report*.py, test_render*.py) are counted apart."""

import ast
import pathlib
import sys

SEARCH = {'startswith', 'endswith', 'count', 'index', 'find', 'search', 'match', 'fullmatch', 'findall'}


def is_str(n):
    return (isinstance(n, ast.Constant) and isinstance(n.value, str)) or isinstance(n, ast.JoinedStr)


def path(n):
    """A leaf path or its prefix (`'first_step/grads/'`, `'ema/'`): a name, not wording."""
    return isinstance(n, ast.Constant) and '/' in n.value and ' ' not in n.value


def collection(n):
    """A literal or built collection of values (`'x' in [leaf.name ...]`, `in {...}`, `in set(...)`): a membership
    test of a name, not a search of text."""
    if isinstance(
        n, (ast.List, ast.ListComp, ast.Set, ast.SetComp, ast.Tuple, ast.GeneratorExp, ast.Dict, ast.DictComp)
    ):
        return True
    return (
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ('set', 'list', 'sorted', 'frozenset', 'tuple')
    )


def wording(test):
    for n in ast.walk(test):
        if isinstance(n, ast.Compare):
            left = n.left
            for op, right in zip(n.ops, n.comparators, strict=False):
                if isinstance(op, (ast.In, ast.NotIn)) and is_str(left) and not collection(right):
                    return True
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    for side in (left, right):
                        if isinstance(side, ast.Constant) and isinstance(side.value, str) and ' ' in side.value.strip():
                            return True
                left = right
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SEARCH:
            lits = [a for a in n.args if is_str(a)] + [
                e for a in n.args if isinstance(a, ast.Tuple) for e in a.elts if is_str(e)
            ]
            if any(not path(a) for a in lits):
                return True
    return False


root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith('-') else 'tests')
verbose = '-v' in sys.argv
total = words = report_own = 0
per = {}
for f in sorted(root.glob('**/*.py')):
    tree = ast.parse(f.read_text())
    own = f.name.startswith(('test_report', 'test_render'))
    for n in ast.walk(tree):
        if isinstance(n, ast.Assert):
            total += 1
            if wording(n.test):
                if own:
                    report_own += 1
                else:
                    words += 1
                    per[f.name] = per.get(f.name, 0) + 1
                if verbose:
                    print(f'{f}:{n.lineno}: {ast.unparse(n.test)[:110]}')
print(f'asserts {total}; wording asserts outside report/ tests {words}; in report/ tests {report_own}')
for name, k in sorted(per.items(), key=lambda kv: -kv[1]):
    print(f'  {k:4d} {name}')
