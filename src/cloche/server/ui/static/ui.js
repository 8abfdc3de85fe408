// The inspector's own script. No inline script anywhere: the pages' CSP forbids it.
"use strict";

// Every htmx request carries the sign-in's CSRF token (from the page's meta tag), as the
// plain forms carry it in a hidden field.
document.addEventListener("htmx:configRequest", function (event) {
  var meta = document.querySelector('meta[name="csrf-token"]');
  if (meta) {
    event.detail.headers["X-CSRF-Token"] = meta.getAttribute("content");
  }
});

// A refused htmx request (a busy session, one gone) says why in the flash area, as text.
document.addEventListener("htmx:responseError", function (event) {
  var flash = document.getElementById("flash");
  if (!flash) {
    return;
  }
  var xhr = event.detail.xhr;
  // An inert document (DOMParser's runs nothing and loads nothing): only its text is used.
  var parsed = new DOMParser().parseFromString(xhr.responseText, "text/html");
  var text = (parsed.body.textContent || "").trim() || "request failed (" + xhr.status + ")";
  var line = document.createElement("p");
  line.className = "error";
  line.textContent = text;
  flash.replaceChildren(line);
});

// Ctrl+Enter (or Cmd+Enter) in the code box runs the cell.
document.addEventListener("keydown", function (event) {
  var box = event.target;
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && box.form && box.name === "code") {
    event.preventDefault();
    box.form.requestSubmit();
  }
});

// A session's terminal: its page opened in the frame on demand (each opening is a new
// shell); the button then closes it (the frame's page goes, its socket closes, the shell is
// hung up).
document.addEventListener("click", function (event) {
  var button = event.target.closest ? event.target.closest("[data-terminal]") : null;
  var frame = document.getElementById("terminal-frame");
  if (!button || !frame) {
    return;
  }
  if (frame.hidden) {
    frame.src = button.dataset.terminal;
    frame.hidden = false;
    button.textContent = "Close the terminal";
  } else {
    frame.src = "about:blank";
    frame.hidden = true;
    button.textContent = "Open a terminal";
  }
});

// The event tail (/ui/events): each event of the caller's a row, newest first, as text.
function eventRow(tail, event) {
  var row = document.createElement("tr");
  row.className = "event";
  row.dataset.type = event.type || "";
  var time = String(event.time || "");
  var cells = [time.slice(11, 23), event.type || "", "", JSON.stringify(event.data || {})];
  cells.forEach(function (text, index) {
    var cell = document.createElement("td");
    if (index === 0) {
      cell.title = time;
    }
    if (index === 2 && event.session_id) {
      var link = document.createElement("a");
      link.href = tail.dataset.sessions + encodeURIComponent(event.session_id);
      link.textContent = String(event.session_id).slice(0, 8);
      cell.appendChild(link);
    } else {
      cell.textContent = text;
    }
    row.appendChild(cell);
  });
  return row;
}

function follow(url, onEvent) {
  if (!window.EventSource) {
    return;
  }
  var source = new EventSource(url);
  source.onmessage = function (message) {
    try {
      onEvent(JSON.parse(message.data));
    } catch (error) {
      // not an event of ours: ignored
    }
  };
}

document.addEventListener("DOMContentLoaded", function () {
  var tail = document.getElementById("event-tail");
  if (tail) {
    var keep = parseInt(tail.dataset.keep, 10) || 200;
    follow(tail.dataset.source, function (event) {
      tail.insertBefore(eventRow(tail, event), tail.firstChild);
      while (tail.children.length > keep) {
        tail.removeChild(tail.lastChild);
      }
    });
  }
  // A session's page: its cells and state are fetched again as soon as the bus says
  // something happened to it (the page also polls, for output while a cell runs).
  var live = document.getElementById("live");
  if (live && window.htmx) {
    follow(live.dataset.events, function () {
      var history = document.getElementById("history");
      if (history) {
        window.htmx.trigger(history, "refresh");
      }
    });
  }
});
