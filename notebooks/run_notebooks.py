"""Execute notebooks headless, in the order given, saving their outputs in place.

    python notebooks/run_notebooks.py notebooks/io_complexity.ipynb notebooks/scaling.ipynb

Used by `make figures`. Each notebook runs with notebooks/ as its working directory,
reads results/ and writes figures/ and paper/generated/; a failing cell stops the run.
"""

import os
import sys

import nbclient
import nbformat


def run(path, timeout=1200):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()
    nbformat.write(notebook, path)


if __name__ == "__main__":
    for notebook_path in sys.argv[1:]:
        print(f"executing {notebook_path}", flush=True)
        run(os.path.abspath(notebook_path))
