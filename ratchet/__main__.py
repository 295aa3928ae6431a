from ratchet.cli import app

app(prog_name="ratchet")
