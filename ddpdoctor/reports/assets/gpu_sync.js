(function(){
  var tl = document.getElementById('timeline'), g = document.getElementById('gpu-panels');
  if(!tl || !g || !tl.on){return;}
  function follow(){
    var r = tl.layout && tl.layout.xaxis && tl.layout.xaxis.range;
    if(r){Plotly.relayout(g, {'xaxis.range': [r[0], r[1]]});}
  }
  tl.on('plotly_relayout', follow);
  follow();
})();
