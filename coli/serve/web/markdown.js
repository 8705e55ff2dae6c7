// A small markdown renderer for model answers: fenced code, inline code, bold, italics, headings, lists,
// links and paragraphs. Everything is HTML-escaped first, so model text can never inject markup.
"use strict";

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function inline(s) {
  // s is already escaped; code spans first so their content is not formatted further
  const parts = s.split(/(`[^`\n]+`)/g);
  return parts.map((p) => {
    if (p.length > 1 && p.startsWith("`") && p.endsWith("`")) return "<code>" + p.slice(1, -1) + "</code>";
    return p
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  }).join("");
}

function renderMarkdown(src) {
  const out = [];
  const fences = src.split(/^```/m);  // even pieces are prose, odd pieces are code (an open fence still streams)
  fences.forEach((piece, i) => {
    if (i % 2 === 1) {
      const nl = piece.indexOf("\n");
      const body = nl >= 0 ? piece.slice(nl + 1) : "";
      out.push("<pre><code>" + escapeHtml(body.replace(/\n$/, "")) + "</code></pre>");
      return;
    }
    let list = null;
    const para = [];
    const flush = () => {
      if (para.length) out.push("<p>" + para.map((l) => inline(escapeHtml(l))).join("<br>") + "</p>");
      para.length = 0;
    };
    const closeList = () => { if (list) { out.push("</" + list + ">"); list = null; } };
    for (const line of piece.split("\n")) {
      const h = line.match(/^(#{1,4})\s+(.*)$/);
      const ul = line.match(/^\s*[-*]\s+(.*)$/);
      const ol = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (h) { flush(); closeList(); out.push(`<h${h[1].length + 2}>` + inline(escapeHtml(h[2])) + `</h${h[1].length + 2}>`); }
      else if (ul || ol) {
        flush();
        const kind = ul ? "ul" : "ol";
        if (list !== kind) { closeList(); out.push("<" + kind + ">"); list = kind; }
        out.push("<li>" + inline(escapeHtml((ul || ol)[1])) + "</li>");
      } else if (!line.trim()) { flush(); closeList(); }
      else { closeList(); para.push(line); }
    }
    flush(); closeList();
  });
  return out.join("");
}
