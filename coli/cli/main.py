"""The `coli` command: one module per subcommand, registered here."""

from __future__ import annotations

import typer

from coli import __version__

app = typer.Typer(
    name="coli",
    help="ColiStream: serve Mixture-of-Experts models far larger than GPU memory (GLM-5.x) by streaming "
         "experts NVMe -> RAM -> VRAM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"coli {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """ColiStream command line."""


def _register() -> None:
    # Each module defines `register(app)`; importing here keeps `coli --help` fast and the modules small.
    from coli.cli import bench, chat, convert, doctor, inspect, logs, plan, run, serve, sim, stats, up, verify
    for module in (run, convert, inspect, verify, up, chat, logs, stats, serve, sim, plan, doctor, bench):
        module.register(app)
    from coli.cli import models, pull   # getting models: coli pull, coli models [rm]
    for module in (pull, models):
        module.register(app)


_register()

if __name__ == "__main__":
    app()
