"""The paper's conventions, checked statically (the LaTeX build itself is `make paper`, in CI):

- every section and generated file that main.tex inputs exists;
- every macro a section uses that looks generated is defined in paper/generated/;
- every figure is drawn by a notebook that exists and is named in a comment above it;
- every citation key is in a bibliography file;
- the README's headline table matches the generated macros.
"""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "paper")


def read(path):
    with open(path) as f:
        return f.read()


def sections():
    return sorted(glob.glob(os.path.join(PAPER, "sections", "*.tex")))


def generated_macros():
    macros = set()
    for path in glob.glob(os.path.join(PAPER, "generated", "*.tex")):
        if os.path.basename(path) != "not_measured.tex":  # the fallback must stay empty
            macros |= set(re.findall(r"\\newcommand\{\\(\w+)\}", read(path)))
    return macros


def test_main_inputs_exist():
    main = read(os.path.join(PAPER, "main.tex"))
    inputs = re.findall(r"\\input\{([^}]+)\}", main)
    assert any(i.startswith("generated/") for i in inputs)
    for path in inputs + [s for p in sections() for s in re.findall(r"\\input\{([^}]+)\}",
                                                                     read(p))]:
        assert os.path.exists(os.path.join(PAPER, path + ".tex")), path
    bibs = re.search(r"\\bibliography\{([^}]+)\}", main).group(1).split(",")
    for bib in bibs:
        assert os.path.exists(os.path.join(PAPER, bib.strip() + ".bib")), bib


def test_generated_macros_are_defined():
    """A macro used in the text with a generated prefix must come from paper/generated/."""
    defined = generated_macros()
    # a GPU class's macros start with its spelled-out name (HOneZeroZero...): prefix "H"
    prefixes = {re.match(r"[A-Z][a-z]*", m).group(0) for m in defined}
    standard = {"Comment", "State", "For", "EndFor", "If", "EndIf", "Return", "Require",
                "Ensure", "Theta"}
    for path in sections():
        for name in set(re.findall(r"\\([A-Z]\w+)", read(path))) - standard:
            prefix = re.match(r"[A-Z][a-z]*", name)
            if prefix and prefix.group(0) in prefixes:
                assert name in defined, f"{os.path.basename(path)}: \\{name} is not generated"


def test_every_figure_names_its_notebook():
    for path in sections():
        lines = read(path).splitlines()
        for n, line in enumerate(lines):
            m = re.search(r"\\includegraphics(\[[^]]*\])?\{([^}]+)\}", line)
            if not m:
                continue
            comments = " ".join(lines[max(0, n - 3):n])
            notebook = re.search(r"%[^%]*?(notebooks/\S+\.ipynb)", comments)
            assert notebook, f"{os.path.basename(path)}:{n + 1}: no notebook named above {m[2]}"
            assert os.path.exists(os.path.join(ROOT, notebook.group(1))), notebook.group(1)
            if "\\" in m.group(2):  # a GPU's figure, named by a macro once its results exist
                continue
            stem = os.path.splitext(m.group(2))[0] if m.group(2).endswith(".pdf") else m.group(2)
            figure = glob.glob(os.path.join(ROOT, "figures", stem + ".pdf"))
            assert figure, f"figures/{m.group(2)} does not exist"


def test_citations_are_in_the_bibliography():
    keys = set()
    for path in glob.glob(os.path.join(PAPER, "*.bib")):
        keys |= set(re.findall(r"@\w+\{([^,\s]+),", read(path)))
    for path in sections():
        for group in re.findall(r"\\cite\w*(?:\[[^]]*\])*\{([^}]+)\}", read(path)):
            for key in group.split(","):
                assert key.strip() in keys, f"{os.path.basename(path)}: {key} not in *.bib"


def test_readme_headline_table_is_current():
    pytest.importorskip("pandas")  # readme_table imports the results module for its writer
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "notebooks", "readme_table.py"),
                           "--check"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
