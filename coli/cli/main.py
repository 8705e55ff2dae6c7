"""The `coli` command: one module per subcommand, registered here."""

from __future__ import annotations

import sys

import typer

from coli import __version__


class _Coli(typer.Typer):
    """typer.Typer whose usage errors (a missing or bad option, an unknown command) are one line on stderr,
    `error: ...` naming the option, as every other error is (docs/cli.md), instead of click's usage block or
    rich's five-line box. Exit codes stay click's (2 for usage errors)."""

    def __call__(self, *args, **kwargs):
        try:
            from typer._click import exceptions as click_exc   # typer >= 0.2x carries its own click
        except ImportError:
            from click import exceptions as click_exc
        try:
            kwargs.setdefault("prog_name", "coli")   # also under `python -m coli.cli.main`
            rv = typer.main.get_command(self).main(*args, standalone_mode=False, **kwargs)
        except getattr(click_exc, "NoArgsIsHelpError", ()) as e:   # `coli` / `coli bench` alone: the help, exit 2
            e.show()
            sys.exit(e.exit_code)
        except click_exc.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "coli"
            typer.secho(f"error: {e.format_message()} (see `{where} --help`)", err=True, fg=typer.colors.RED)
            sys.exit(e.exit_code)
        except click_exc.ClickException as e:
            typer.secho(f"error: {e.format_message()}", err=True, fg=typer.colors.RED)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("", err=True)
            sys.exit(1)
        # Outside standalone mode click returns typer.Exit's code, or the command's return value (None here).
        sys.exit(rv if isinstance(rv, int) else 0)


app = _Coli(
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
    from coli.cli import bench, chat, convert, doctor, inspect, logs, plan, ps, run, serve, sim, stats, up, verify
    for module in (run, convert, inspect, verify, up, ps, chat, logs, stats, serve, sim, plan, doctor, bench):
        module.register(app)
    from coli.cli import models, pull   # getting models: coli pull, coli models [rm]
    for module in (pull, models):
        module.register(app)


_register()

if __name__ == "__main__":
    app()
