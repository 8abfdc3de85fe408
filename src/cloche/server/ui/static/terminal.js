// The terminal of a session (/ui/sessions/{id}/terminal): xterm.js over the session's
// terminal socket. No inline script: what it needs is read from the page's data attributes.
// Binary frames are the terminal's bytes both ways; {"resize": {cols, rows}} follows the
// page's size; {"exit": {exit_code, signal}} tells the shell's end.
"use strict";

document.addEventListener("DOMContentLoaded", function () {
  var box = document.getElementById("terminal");
  var status = document.getElementById("terminal-status");
  if (!box || !window.Terminal || !window.FitAddon) {
    return;
  }
  function say(text) {
    if (status) {
      status.textContent = text;
    }
  }
  var terminal = new window.Terminal({ cursorBlink: true, scrollback: 5000 });
  var fit = new window.FitAddon.FitAddon();
  terminal.loadAddon(fit);
  terminal.open(box);
  fit.fit();

  var query = "?cols=" + terminal.cols + "&rows=" + terminal.rows +
    "&csrf_token=" + encodeURIComponent(box.dataset.csrf || "");
  var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
  var socket = new WebSocket(scheme + window.location.host + box.dataset.socket + query);
  socket.binaryType = "arraybuffer";
  var encoder = new TextEncoder();
  var ended = null;

  function send(data) {
    if (socket.readyState === WebSocket.OPEN) {
      socket.send(data);
    }
  }
  socket.onopen = function () {
    say("connected: a shell in the session's sandbox; closing this hangs it up");
    terminal.focus();
  };
  socket.onmessage = function (message) {
    if (typeof message.data !== "string") {
      terminal.write(new Uint8Array(message.data));
      return;
    }
    try {
      ended = JSON.parse(message.data).exit || ended;
    } catch (error) {
      // not a message of ours: ignored
    }
  };
  socket.onclose = function (event) {
    terminal.options.disableStdin = true;
    if (ended) {
      say(ended.exit_code !== null ? "the shell exited with " + ended.exit_code
        : "the shell ended" + (ended.signal ? " (" + ended.signal + ")" : ""));
    } else if (event.code >= 4000) {
      say("refused: " + (event.reason || event.code));
    } else {
      say("disconnected");
    }
  };
  terminal.onData(function (data) {
    send(encoder.encode(data));
  });
  terminal.onBinary(function (data) {
    var bytes = new Uint8Array(data.length);
    for (var index = 0; index < data.length; index += 1) {
      bytes[index] = data.charCodeAt(index) & 255;
    }
    send(bytes);
  });
  terminal.onResize(function (size) {
    send(JSON.stringify({ resize: { cols: size.cols, rows: size.rows } }));
  });
  window.addEventListener("resize", function () {
    fit.fit();
  });
});
