"""The README and the docs stay a manual a newcomer reads in minutes: the README says what the suite is in at
most 120 words before its first command, in sentences of at most 45 words; no page of docs/ runs past 400
lines; and neither holds a date or an issue number (our history is in git and CHANGELOG.md)."""

import glob
import os
import re

from conftest import ROOT

MAX_WORDS_BEFORE_COMMAND = 120
MAX_SENTENCE_WORDS = 45
MAX_PAGE_LINES = 400
DATE = re.compile(r'\b(19|20)\d\d-\d\d-\d\d\b')
ISSUE = re.compile(r'\bissues? \d+', re.IGNORECASE)
FENCED = re.compile(r'^```.*?^```', re.S | re.M)
SAMPLE = re.compile(r'^<!-- sample report:.*?-->\n```.*?^```', re.S | re.M)  # the report's own words, as it prints them
PAGES = sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def read(path: str) -> str:
    with open(path, encoding='utf-8') as f:
        return f.read()


def words_before_first_command(text: str) -> int:
    return len(text.split('```', 1)[0].split())


def long_sentences(text: str, limit: int = MAX_SENTENCE_WORDS) -> list[str]:
    """The prose's sentences over ``limit`` words: fenced blocks, headings, tables and list items' link lists
    left out; a sentence ends at '.', '!' or '?' followed by a space or the end of its paragraph."""
    prose = [p for p in FENCED.sub('', text).split('\n\n') if p.strip() and p.lstrip()[0] not in '#|-<']
    sentences = [s for p in prose for s in re.split(r'(?<=[.!?])\s+', ' '.join(p.split()))]
    return [s for s in sentences if len(s.split()) > limit]


def history(text: str) -> list[str]:
    return [m.group(0) for pattern in (DATE, ISSUE) for m in pattern.finditer(text)]


def test_the_readme_says_what_the_suite_is_briefly():
    readme = read(os.path.join(ROOT, 'README.md'))
    assert words_before_first_command(readme) <= MAX_WORDS_BEFORE_COMMAND
    assert long_sentences(readme) == []
    assert history(SAMPLE.sub('', readme)) == []


def test_every_page_of_the_docs_is_short_and_holds_no_history():
    assert PAGES
    long = {os.path.basename(p): n for p in PAGES if (n := len(read(p).splitlines())) > MAX_PAGE_LINES}
    assert long == {}, f'over {MAX_PAGE_LINES} lines: split the page by what it is for'
    found = {os.path.basename(p): h for p in PAGES if (h := history(read(p)))}
    assert found == {}, 'dates and issue numbers belong in git and CHANGELOG.md'


def test_the_measures_see_what_they_measure():
    """The negative control: each measure finds what it must on text written to break it."""
    assert words_before_first_command('one two three\n```bash\nx\n```\nfour') == 3
    assert long_sentences(' '.join(['word'] * 46) + '. Short one.') and not long_sentences('Short. Two words.')
    assert long_sentences('```\n' + ' '.join(['code'] * 50) + '\n```\n') == []
    assert history('measured on 2026-12-06 (issue 59)') == ['2026-12-06', 'issue 59']


def test_the_sample_comparison_masks_figures_and_holds_words_and_order():
    """The README's sample blocks are compared with real runs in ``test_cli``; here the comparison itself, on the
    README's own MISMATCH block taken as a report: other figures fit, other words or another order do not."""
    from readme_sample import fits, samples

    block = samples()['--perturb 1e-4']
    figures = [line.translate(str.maketrans('0123456789', '7301942865')) for line in block]
    assert fits(block, block) and fits(block, figures)
    where = next(i for i, line in enumerate(block) if line.startswith('where:'))
    swapped = [*block[: where - 1], block[where], block[where - 1], *block[where + 1 :]]
    reworded = [line.replace('diagnosis', 'finding') for line in block]
    assert not fits(block, swapped) and not fits(block, reworded) and not fits(block, block[:-1])
