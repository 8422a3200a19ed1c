"""Writes what is not JSON to stdout: a banner before it speaks the
protocol, and a line in the middle of a call."""
import os

from mcp.server.mcpserver import MCPServer

os.write(1, b"noisy server 1.0 starting up, hello!\n")
server = MCPServer("noisy")


@server.tool()
def speak() -> str:
    """Writes a stray line to stdout, then answers."""
    os.write(1, b"*** not json ***\n")
    return "spoke"


server.run("stdio")
